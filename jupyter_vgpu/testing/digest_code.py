"""Kernel code that defines ``digest(arrays)``: the SHA-256, hex, of the arrays' bytes in
order (NumPy arrays, or anything ``np.ascontiguousarray`` takes), for the coverage test and
benchmark (``tests/gpu/test_coverage.py``, ``benchmarks/coverage.py``) to compare a kernel's
data before and after it went away."""

DIGEST = (
    "import hashlib, numpy as np\n"
    "def digest(arrays):\n"
    "    h = hashlib.sha256()\n"
    "    for a in arrays:\n"
    "        h.update(np.ascontiguousarray(a).tobytes())\n"
    "    return h.hexdigest()\n"
)
