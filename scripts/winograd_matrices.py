#!/usr/bin/env python3
"""The transforms of a Winograd (Toom-Cook) minimal filtering algorithm F(m, r),
in exact rationals: y = A^T [ (G g) . (B^T d) ] computes the m outputs
y_k = sum_j g_j d_(k+j) (a correlation, as conv2d computes) of an r-tap filter
g over an alpha = m + r - 1 input tile d with alpha multiplies.

Construction (Lavin and Gray 2015, after Toom and Cook): the interpolation
points p_0 .. p_(alpha-2) and infinity; A^T's column i is (1, p_i, .., p_i^(m-1))
(infinity's: (0, .., 0, 1)); G's row i is (1, p_i, .., p_i^(r-1)) / f_i with
f_i = prod_(j != i) (p_i - p_j) (infinity's: (0, .., 0, 1)); B^T is then the one
matrix that makes the identity hold for every g and d: solved here from the
m * r * alpha linear equations sum_i A^T[k, i] G[i, j] B^T[i, l] = [l == k + j]
(exactly, by Gaussian elimination over fractions; the system is checked to
have one solution and every equation to hold).

csrc/winograd_lanes.c's F(3, 5) and F(4, 3) constants come from here
(python3 scripts/winograd_matrices.py 3 5, and 4 3, print them);
tests/test_winograd_lanes.py imports transforms() for its error bounds. Standard library only.
"""
import sys
from fractions import Fraction as Fr

# The points, per (m, r): 0, +-1, +-2 and +-1/2 keep the entries small (the
# transforms' norms are what multiplies float32's rounding error).
POINTS = {
    (2, 3): [Fr(0), Fr(1), Fr(-1)],
    (3, 5): [Fr(0), Fr(1), Fr(-1), Fr(2), Fr(-2), Fr(1, 2)],
    (4, 3): [Fr(0), Fr(1), Fr(-1), Fr(2), Fr(-2)],
}


def solve(rows, rhs):
    """The unique x of rows x = rhs (exact; raises when there is none or many)."""
    n = len(rows[0])
    a = [list(r) + [b] for r, b in zip(rows, rhs)]
    piv_row, where = 0, [-1] * n
    for col in range(n):
        p = next((i for i in range(piv_row, len(a)) if a[i][col] != 0), None)
        if p is None:
            raise ValueError("the system has more than one solution")
        a[piv_row], a[p] = a[p], a[piv_row]
        inv = 1 / a[piv_row][col]
        a[piv_row] = [v * inv for v in a[piv_row]]
        for i in range(len(a)):
            if i != piv_row and a[i][col] != 0:
                f = a[i][col]
                a[i] = [v - f * u for v, u in zip(a[i], a[piv_row])]
        where[col] = piv_row
        piv_row += 1
    for i in range(piv_row, len(a)):
        if a[i][n] != 0:
            raise ValueError("the system has no solution")
    return [a[where[c]][n] for c in range(n)]


def transforms(m, r, points=None):
    """(A^T (m, alpha), G (alpha, r), B^T (alpha, alpha)) as lists of Fractions."""
    pts = POINTS[(m, r)] if points is None else [Fr(p) for p in points]
    alpha = m + r - 1
    if len(pts) != alpha - 1 or len(set(pts)) != len(pts):
        raise ValueError(f"F({m}, {r}) needs {alpha - 1} distinct finite points")
    AT = [[p ** k for p in pts] + [Fr(int(k == m - 1))] for k in range(m)]
    G = []
    for i, p in enumerate(pts):
        f = Fr(1)
        for j, q in enumerate(pts):
            if j != i:
                f *= p - q
        G.append([p ** j / f for j in range(r)])
    G.append([Fr(int(j == r - 1)) for j in range(r)])
    # unknowns: B^T[i][l], index i * alpha + l
    rows, rhs = [], []
    for k in range(m):
        for j in range(r):
            for l in range(alpha):
                row = [Fr(0)] * (alpha * alpha)
                for i in range(alpha):
                    row[i * alpha + l] = AT[k][i] * G[i][j]
                rows.append(row)
                rhs.append(Fr(int(l == k + j)))
    x = solve(rows, rhs)
    BT = [x[i * alpha:(i + 1) * alpha] for i in range(alpha)]
    return AT, G, BT


def c_array(name, mat):
    body = ",\n".join("    {" + ", ".join(f"{float(v)!r}f" for v in row) + "}" for row in mat)
    return f"static const float {name}[{len(mat)}][{len(mat[0])}] = {{\n{body}}};"


def main(argv):
    m, r = (int(argv[1]), int(argv[2])) if len(argv) > 2 else (3, 5)
    AT, G, BT = transforms(m, r)
    for row in G:  # every entry must be exact in float32 (the C side writes them as literals)
        for v in row:
            if Fr(float(v)) != v and abs(float(v)) > 0:
                print(f"/* note: G entry {v} rounds in float32 */")
    print(c_array("WT_AT", AT))
    print(c_array("WT_G", G))
    print(c_array("WT_BT", BT))
    print("/* exact:", "AT =", [[str(v) for v in row] for row in AT], "*/")
    print("/* exact:", "G =", [[str(v) for v in row] for row in G], "*/")
    print("/* exact:", "BT =", [[str(v) for v in row] for row in BT], "*/")


if __name__ == "__main__":
    main(sys.argv)
