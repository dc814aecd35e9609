"""``python -m jupyter_vgpu.node``: the node arbiter."""

from .app import main

main()
