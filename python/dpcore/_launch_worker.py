"""One process of dp.launch's job: ``python -m dpcore._launch_worker PAYLOAD DIR``.

Loads (fn, args, kwargs) from PAYLOAD (cloudpickle), joins the MPI job, runs
fn; rank 0 writes its result to DIR/result.pkl (atomically). An exception is
written to DIR/error-RANK.txt, then ends the job (MPI_Abort), so that no other
process waits for this one.
"""
import os
import sys
import traceback


def main(payload, directory):
    import cloudpickle

    from dpcore import distributed

    rank = distributed.rank()  # joins the job
    try:
        with open(payload, "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
        result = fn(*args, **kwargs)
        if rank == 0:
            tmp = os.path.join(directory, "result.pkl.tmp")
            with open(tmp, "wb") as f:
                cloudpickle.dump(result, f)
            os.replace(tmp, os.path.join(directory, "result.pkl"))
    except BaseException:
        text = traceback.format_exc()
        tmp = os.path.join(directory, f"error-{rank}.txt.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(directory, f"error-{rank}.txt"))
        sys.stderr.write(f"dpcore: rank {rank} failed; aborting the job (MPI_Abort)\n{text}")
        distributed._abort_job(1)
        raise


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m dpcore._launch_worker PAYLOAD DIR")
    main(sys.argv[1], sys.argv[2])
