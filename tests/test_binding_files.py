"""The binding's files (csrc/py_*.c over csrc/py_private.h) use one another in
one direction: each uses only files that py_private.h lists above it, so
py_common.c uses none, py_module.c is used by none, and no files use one
another round a circle.

Read from the sources, without a build: the names py_private.h declares
DP_PY_LOCAL, the one file that defines each (a definition starts a line), and
the files that use each (the name as a word, comments left out).
"""
import os
import re

import pytest

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "csrc")
HEADER = os.path.join(CSRC, "py_private.h")


def read(path):
    with open(path) as f:
        return f.read()


def without_comments(text):
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", text, flags=re.S))


def listed_files():
    """The files in the order py_private.h's opening comment lists them."""
    opening = read(HEADER).split("*/", 1)[0]
    return re.findall(r"^ \*   (py_\w+\.c) ", opening, flags=re.M)


def shared_names():
    """The names py_private.h declares DP_PY_LOCAL (functions, variables)."""
    text = re.sub(r"^#[^\n]*", "", without_comments(read(HEADER)), flags=re.M)
    names = set()
    for decl in re.findall(r"DP_PY_LOCAL\s+([^;{]*?)(?:\(|;|\[)", text):
        names.add(re.findall(r"\w+", decl)[-1])
    return names


def sources():
    return {name: without_comments(read(os.path.join(CSRC, name)))
            for name in sorted(os.listdir(CSRC)) if re.fullmatch(r"py_\w+\.c", name)}


def homes(files, names):
    """{name: the file that defines it}: a line that starts with its type and
    names it before an opening parenthesis, an initializer or a semicolon."""
    out = {}
    for name in names:
        pattern = re.compile(r"^(?!static\b)[A-Za-z_][\w \*]*?\b%s\b\s*(\(|\[\]\s*=|=|;)" % re.escape(name), re.M)
        found = [f for f, text in files.items() if pattern.search(text)]
        assert len(found) == 1, f"{name} is defined in {found or 'no file'}: one home each"
        out[name] = found[0]
    return out


def uses():
    """{file: {files whose shared names it uses}}"""
    files = sources()
    home = homes(files, shared_names())
    graph = {f: set() for f in files}
    for name, owner in home.items():
        word = re.compile(r"\b%s\b" % re.escape(name))
        for f, text in files.items():
            if f != owner and word.search(text):
                graph[f].add(owner)
    return graph


def test_every_file_is_listed_once():
    assert sorted(listed_files()) == sorted(sources()), "py_private.h lists every py_*.c file, once"


def test_common_uses_no_other_file_and_no_file_uses_the_module():
    graph = uses()
    assert graph["py_common.c"] == set()
    assert [f for f, used in graph.items() if "py_module.c" in used] == []


def test_each_file_uses_only_files_listed_above_it():
    order = listed_files()
    graph = uses()
    for f, used in graph.items():
        above = set(order[:order.index(f)])
        assert used <= above, f"{f} uses {sorted(used - above)}, listed below it in py_private.h"


def test_the_files_form_no_cycle():
    graph = uses()
    done, path = set(), []

    def visit(f):
        if f in path:
            pytest.fail("a cycle: " + " -> ".join(path[path.index(f):] + [f]))
        if f in done:
            return
        path.append(f)
        for g in sorted(graph[f]):
            visit(g)
        path.pop()
        done.add(f)

    for f in sorted(graph):
        visit(f)


def test_the_files_include_only_the_private_header_of_the_binding():
    for f in sources():
        text = read(os.path.join(CSRC, f))
        local = [h for h in re.findall(r'#include "([^"]+)"', text) if h.startswith("py_") or h.endswith(".c")]
        assert local == ["py_private.h"], f"{f} includes {local}"
