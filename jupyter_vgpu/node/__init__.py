"""The node arbiter: one process per GPU host that owns its cards (see DESIGN.md)."""
