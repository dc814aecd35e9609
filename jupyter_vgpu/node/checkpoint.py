"""``python -m jupyter_vgpu.node.checkpoint``: the driver's checkpoint helper by the name it
had before it moved to :mod:`jupyter_vgpu.host.checkpoint`. A kernel started before an
upgrade runs its helper (a suspend in chaos mode, or restoring itself when its arbiter
has died) by that name, from the code installed now; this keeps such a kernel's way back.
"""

import sys

from jupyter_vgpu.host.checkpoint import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
