"""The text a cell's output message shows, the same way for every client of the tests
(the kernel runner, the fault scenes' timed runs, the Lab client over the server's
websocket)."""

from __future__ import annotations


def output_text(kind: str, content: dict, traceback: bool = False) -> str | None:
    """The text of an IOPub message of type ``kind`` with ``content``: a stream's text, a
    result's or display's ``text/plain``, an error's ``ename: evalue`` line (and its
    traceback, with ``traceback``); None for any other message."""
    if kind == "stream":
        return content["text"]
    if kind in ("execute_result", "display_data"):
        return content["data"].get("text/plain", "")
    if kind == "error":
        line = f"{content['ename']}: {content['evalue']}\n"
        return line + "\n".join(content.get("traceback", [])) if traceback else line
    return None
