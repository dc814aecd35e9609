"""Cells of the GPU tests whose kernels pause and keep only their CUDA contexts on the
card, for another kernel's room: each holds 256 MiB of random bytes (uint8, seeded) and
remembers their SHA-256, so that a resume or a restore is checked bit for bit; the
kernel that needs the room grows by 2 GiB."""

#: Hold 256 MiB of random bytes on the card and keep their digest; prints ``held``.
HOLD = (
    "import hashlib, torch\n"
    "g = torch.Generator(device='cuda').manual_seed({seed})\n"
    "data = torch.randint(0, 256, (256 * 2**20,), dtype=torch.uint8, device='cuda', generator=g)\n"
    "digest = hashlib.sha256(data.cpu().numpy()).hexdigest()\n"
    "print('held')"
)
#: Prints ``True`` when the bytes are what they were.
CHECK = "print(hashlib.sha256(data.cpu().numpy()).hexdigest() == digest)"
#: 2 GiB more on the card; prints ``grew``.
GROW = (
    "import torch\n"
    "x = torch.ones(2 * 2**30, dtype=torch.uint8, device='cuda')\n"
    "print('grew', int(x[::4096].sum()))"
)
