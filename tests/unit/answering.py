"""A kernel's connection for tests of the arbiter's own path: it answers every request at
once, as a kernel that paused (nothing left to release on the card), and keeps what it
was asked and told."""

from jupyter_vgpu.node import books


class Answering:
    """Stands where :class:`jupyter_vgpu.node.sessions.Connection` stands: ``kernel``,
        ``pid``, ``ask`` and ``send``, and the room requests' bookkeeping (``room_task``,
        ``room_next``, ``ahead_task``, ``ahead_stop``), its ``hello`` and the node's figures it was last told
    (``node_sent``, for the arbiter's background step). ``asked``: the requests' types, in
        order; ``told``: the messages sent."""

    def __init__(self, kernel: books.Kernel):
        self.kernel, self.pid, self.asked, self.told = kernel, kernel.pid, [], []
        self.room_task = self.room_next = self.ahead_task = None
        self.hello = None  # what it said in its hello (None: nothing; version 1 then)
        self.ahead_stop = False
        self.node_sent = None

    async def ask(self, msg: dict, timeout: float, sent=None) -> dict:
        self.asked.append(msg["type"])
        return {"ok": True, "message": "done", "released": 0}

    async def send(self, msg: dict) -> None:
        self.told.append(msg)
