"""The step timeline measured in C (dp.train(..., profile=True), dp.profile)
and the scaling report built on it.

- every replica and every phase is in the timeline, and a step's top-level
  phases add up to the step as Python measured it around the call (within
  10%, the issue's bound; the median over steps, as a machine shared with
  other work may preempt one step's thread);
- the Chrome trace is valid JSON in the Trace Event Format;
- with profiling off, nothing is recorded;
- the exclusive phase times on hand-made events, against hand arithmetic;
- the report's numbers are the measured steps', its verdict follows from them.
"""
import json
import time

import numpy as np
import pytest

import dpcore as dp
from dpcore import timeline as tl
from dpcore.scaling import ScalingReport

GPUS = dp._core.runtime_info()["cuda_device_count"] if dp.build_info().get("cuda_backend") else 0


def batch(n=256, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n)


@pytest.fixture
def two_cpus():
    dp.set_logical_devices("cpu", 2)
    yield ["cpu:0", "cpu:1"]
    dp.set_logical_devices("cpu", 1)


def profiled_steps(net, steps=8):
    X, y = batch()
    net.train_step(X, y, 0.05)  # warm-up: the first step of a shape sizes buffers
    walls = []
    with dp.profile(net) as p:
        for _ in range(steps):
            start = time.perf_counter_ns()
            net.train_step(X, y, 0.05)
            walls.append(time.perf_counter_ns() - start)
    return p.timeline, walls


def test_every_replica_and_phase_is_recorded_and_the_phases_add_up_to_the_step(two_cpus):
    net = dp.models.LeNet(devices=two_cpus, bucket_mb=0.1)  # several buckets
    timeline, walls = profiled_steps(net)
    assert timeline.dropped == 0
    assert timeline.steps() == list(range(1, 9))  # steps count while recording: the warm-up is not one
    for replica in (0, 1):
        phases = {tl.PHASES[p] for p in timeline.events[timeline.events["replica"] == replica]["phase"]}
        assert phases == set(tl.PHASES), phases
        buckets = {int(b) for b in timeline._of(replica, 1, "allreduce")["bucket"]}
        assert buckets == set(range(len(net.gradient_buckets))), (buckets, net.gradient_buckets)
    times = timeline.step_times()
    errors = []
    for (replica, step), (span, top) in times.items():
        assert top <= span and top >= 0.99 * span, (replica, step, span, top)  # the phases tile the step
        errors.append(abs(top - walls[step - 1]) / walls[step - 1])
    assert np.median(errors) < 0.10, sorted(errors)


def test_one_replica_has_no_collectives():
    net = dp.models.LeNet()
    timeline, walls = profiled_steps(net, steps=4)
    phases = {tl.PHASES[p] for p in timeline.events["phase"]}
    assert phases == {"step", "scatter", "forward", "backward", "update"}
    errors = [abs(top - walls[step - 1]) / walls[step - 1] for (_, step), (_, top) in timeline.step_times().items()]
    assert np.median(errors) < 0.10, errors


def test_profiling_off_records_nothing(two_cpus):
    net = dp.models.LeNet(devices=two_cpus)
    X, y = batch(64)
    net.train_step(X, y, 0.1)
    with dp.profile(net):
        pass
    net.train_step(X, y, 0.1)
    for model in net._replicas:
        events, dropped = model.take_trace()
        assert events.shape == (0, 6) and dropped == 0


def test_dp_train_profile_fills_history_timeline_and_the_chrome_trace_is_valid(two_cpus, tmp_path):
    X, y = batch(512)
    net = dp.models.LeNet(devices=two_cpus)
    history = dp.train(net, dp.data.from_arrays(X, y, 128), num_epochs=2, lr=0.1, verbose=False, profile=True)
    assert dp.train(net, dp.data.from_arrays(X, y, 128), num_epochs=1, verbose=False).timeline is None
    timeline = history.timeline
    assert len(timeline.steps()) == 8
    path = timeline.save(tmp_path / "trace.json")
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(timeline.events)
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 and e["pid"] == 0 for e in complete)
    assert {e["tid"] for e in complete} == {0, 1}
    assert {e["name"] for e in complete} == set(tl.PHASES)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"replica 0 (cpu:0)", "replica 1 (cpu:1)"}
    buckets = [e for e in complete if e["name"] == "allreduce" and "bucket" in e["args"]]
    assert buckets and all(e["args"]["bytes"] > 0 for e in buckets)


def test_the_gantt_chart_draws_a_bar_per_event():
    pytest.importorskip("matplotlib", reason="matplotlib is a test requirement (requirements-dev.txt)")
    timeline, _ = profiled_steps(dp.models.LeNet(), steps=4)
    ax = timeline.plot(steps=2)
    drawn = timeline.events[np.isin(timeline.events["step"], timeline.steps()[-2:])
                            & (timeline.events["phase"] != 0)]
    assert len(ax.patches) == len(drawn)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["replica 0 (cpu:0)"]


def test_exclusive_phase_times_on_hand_made_events():
    # one replica, one step: forward 0-10, backward 10-30 holding an all-reduce
    # 20-28 which holds a wait 22-25; then update 30-31 (nanoseconds)
    rows = [(0, 0, -1, 0, 1, 0, 31), (0, 2, -1, 0, 1, 0, 10), (0, 3, -1, 0, 1, 10, 30), (0, 4, 0, 64, 1, 20, 28),
            (0, 5, -1, 0, 1, 22, 25), (0, 6, -1, 0, 1, 30, 31)]
    timeline = tl.Timeline(np.array(rows, dtype=tl._EVENT_DTYPE), ["cpu:0"])
    seconds = {k: round(v * 1e9) for k, v in timeline.phase_seconds().items()}
    assert seconds == {"scatter": 0, "forward": 10, "backward": 12, "allreduce": 5, "wait": 3, "update": 1}
    inclusive = {k: round(v * 1e9) for k, v in timeline.phase_seconds(exclusive=False).items()}
    assert inclusive["backward"] == 20 and inclusive["allreduce"] == 8
    assert timeline.step_times() == {(0, 1): (31, 31)}
    assert abs(sum(timeline.shares().values()) - 1) < 1e-12


def test_the_scaling_report_comes_from_measured_steps(capsys):
    X, y = batch(512)
    it = dp.data.from_arrays(X, y, 128)
    report = dp.scaling_report(lambda: dp.models.LeNet(), it, devices=["cpu:0", "cpu:1"], steps=3, warmup=1)
    assert dp.list_devices() == ["cpu:0"]  # the logical CPU devices as they were
    assert [r["replicas"] for r in report.rows] == [1, 2]
    for row, timeline in zip(report.rows, report.timelines):
        assert len(row["step_seconds"]) == 3 and len(timeline.steps()) == 3
        assert row["images_per_s"] == pytest.approx(3 * 128 / sum(row["step_seconds"]))
        assert row["compute_share"] + row["comm_share"] + row["wait_share"] == pytest.approx(1.0)
        assert len(set(timeline.events["replica"])) == row["replicas"]
    assert report.rows[1]["speedup"] == pytest.approx(report.rows[1]["images_per_s"] / report.rows[0]["images_per_s"])
    assert report.rows[0]["comm_share"] == 0
    out = capsys.readouterr().out
    assert "| replicas | devices | images/s |" in out and "2 replicas" in out


def test_the_verdict_says_why_replicas_do_not_pay():
    def row(k, ips, compute, comm, wait):
        return {"replicas": k, "devices": [f"cpu:{i}" for i in range(k)], "kind": "cpu", "images_per_s": ips,
                "step_seconds": [1.0], "compute_share": compute, "comm_share": comm, "wait_share": wait,
                "speedup": ips / 1000, "efficiency": ips / 1000 / k}

    slow = ScalingReport([row(1, 1000, 1, 0, 0), row(2, 800, 0.4, 0.35, 0.25)], [], batch_size=32, cores=2)
    assert "2 replicas do not pay: 0.80x" in slow.verdict
    assert "communication and waiting take 60%" in slow.verdict and "more than their compute (40%)" in slow.verdict
    assert "(16 samples) is small" in slow.verdict
    good = ScalingReport([row(1, 1000, 1, 0, 0), row(2, 1950, 0.95, 0.02, 0.03)], [], batch_size=256, cores=2)
    assert good.verdict.startswith("2 replicas pay: 1.95x")
    crowded = ScalingReport([row(1, 1000, 1, 0, 0), row(4, 1100, 0.9, 0.05, 0.05)], [], batch_size=256, cores=2)
    assert "4 replicas share 2 core(s)" in crowded.verdict
    assert "<table>" in good._repr_html_() and "| 2 | cpu:0, cpu:1 | 1950 | 1.95x | 98% |" in good.table()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no usable CUDA device (the CPU twin: "
                    "test_every_replica_and_phase_is_recorded_and_the_phases_add_up_to_the_step)")
def test_gpu_timeline_phases_add_up_to_the_step():
    """ResNet-18, not LeNet: the binding's fixed cost of a call (its checks, the shards, waking the
    replica threads: about 0.1 ms, outside the C timeline) is about a tenth of LeNet's 1 ms GPU step
    (the H100 runs of 2026-11-28 measured 9-13 %), but under 1 % of ResNet-18's ~15 ms one, so the
    10 % bound tests what the timeline records, not the binding's cost."""
    dp.set_logical_devices("cuda", 2)
    try:
        net = dp.models.ResNet18(devices=["cuda:0", "cuda:1"])
        timeline, walls = profiled_steps(net)
        assert {tl.PHASES[p] for p in timeline.events["phase"]} >= {"scatter", "forward", "backward", "allreduce",
                                                                    "update"}
        errors = [abs(top - walls[step - 1]) / walls[step - 1]
                  for (_, step), (_, top) in timeline.step_times().items()]
        assert np.median(errors) < 0.10, errors
    finally:
        dp.set_logical_devices("cuda", 1)
