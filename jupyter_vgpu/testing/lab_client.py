"""Talks to a user's single-user server through the Hub's proxy, as JupyterLab does:
REST for kernels, the kernel websocket for execution."""

from __future__ import annotations

import json
import time
import uuid

import nbformat
import requests
import websocket

from .output_text import output_text


class LabClient:
    """A user's server at ``server_url`` (``{hub}/user/{name}/``).

    Authenticated either with the user's Hub API ``token`` or, like a browser, with the
    ``session`` that logged in through the Hub's login form: its first request then goes
    through the Hub's OAuth flow and the server's cookie joins the session.

    Raises:
        ValueError: neither or both of ``token`` and ``session`` are given.
        AssertionError: the OAuth flow did not reach the server.
    """

    def __init__(self, server_url: str, token: str | None = None, session: requests.Session | None = None):
        if (token is None) == (session is None):
            raise ValueError("give exactly one of token and session")
        self.url = server_url.rstrip("/") + "/"
        self.token = token
        self.session = session or requests.Session()
        self.headers = {"Authorization": f"token {token}"} if token else {}
        if session is not None:
            r = session.get(self.url + "lab", timeout=60)
            if r.status_code != 200 or not r.url.startswith(self.url):
                raise AssertionError(f"OAuth to {self.url} ended at {r.status_code} {r.url}")
            path = "/" + self.url.split("/", 3)[3]
            self.headers = {"X-XSRFToken": session.cookies.get("_xsrf", path=path) or ""}

    def get(self, path: str) -> requests.Response:
        return self.session.get(self.url + path, headers=self.headers, timeout=30)

    def start_kernel(self) -> str:
        r = self.session.post(
            self.url + "api/kernels", json={"name": "python3"}, headers=self.headers, timeout=60
        )
        assert r.status_code == 201, f"start kernel: {r.status_code} {r.text}"
        return r.json()["id"]

    def shutdown_kernel(self, kernel_id: str) -> None:
        self.session.delete(self.url + f"api/kernels/{kernel_id}", headers=self.headers, timeout=30)

    def execute(self, kernel_id: str, code: str, timeout: float = 120) -> str:
        """Run ``code``; return its stdout, results and error text together.

        Raises:
            TimeoutError: the kernel did not go idle within ``timeout`` seconds.
            ConnectionError: the kernel websocket closed before the kernel went idle.
        """
        ws_url = self.url.replace("http", "ws", 1) + f"api/kernels/{kernel_id}/channels"
        deadline = time.monotonic() + timeout
        header = [f"{k}: {v}" for k, v in self.headers.items()]
        cookie = "; ".join(f"{c.name}={c.value}" for c in self.session.cookies if self._sent_to(c.path))
        conn = websocket.create_connection(
            ws_url, header=header, cookie=cookie or None, origin=self.url.rstrip("/"), timeout=timeout
        )
        msg_id = uuid.uuid4().hex
        try:
            conn.send(json.dumps(execute_request(msg_id, code)))
            parts: list[str] = []
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise websocket.WebSocketTimeoutException()
                conn.settimeout(left)
                raw = conn.recv()
                if not raw:
                    raise ConnectionError(f"kernel {kernel_id} websocket closed while running:\n{code}")
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                text = output_text(kind, content)
                if text is not None:
                    parts.append(text)
                elif kind == "status" and content["execution_state"] == "idle":
                    return "".join(parts)
        except websocket.WebSocketTimeoutException:
            raise TimeoutError(
                f"kernel {kernel_id} at {self.url} did not finish within {timeout} s running:\n{code}"
            ) from None
        finally:
            conn.close()

    def terminal(self, command: str, until: str, timeout: float = 60) -> tuple[str, str]:
        """Open a terminal (``POST api/terminals``), type ``command`` in it as JupyterLab's
        terminal does (terminado's websocket), and read its output until ``until`` appears.

        Returns ``(terminal name, output so far)``; the terminal and what runs in it go on.

        Raises:
            TimeoutError: ``until`` did not appear within ``timeout`` seconds.
        """
        r = self.session.post(self.url + "api/terminals", headers=self.headers, timeout=30)
        assert r.status_code == 200, f"new terminal: {r.status_code} {r.text}"
        name = r.json()["name"]
        ws_url = self.url.replace("http", "ws", 1) + f"terminals/websocket/{name}"
        header = [f"{k}: {v}" for k, v in self.headers.items()]
        origin = self.url.rstrip("/")
        conn = websocket.create_connection(ws_url, header=header, origin=origin, timeout=timeout)
        deadline = time.monotonic() + timeout
        text = ""
        try:
            conn.send(json.dumps(["stdin", command + "\r"]))
            while until not in text:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise websocket.WebSocketTimeoutException()
                conn.settimeout(left)
                kind, *rest = json.loads(conn.recv())
                if kind == "stdout":
                    text += rest[0]
        except websocket.WebSocketTimeoutException:
            raise TimeoutError(
                f"terminal {name} did not print {until!r} within {timeout} s:\n{text[-2000:]}"
            ) from None
        finally:
            conn.close()
        return name, text

    def _sent_to(self, cookie_path: str | None) -> bool:
        """Whether a browser sends a cookie of ``cookie_path`` to this server."""
        return ("/" + self.url.split("/", 3)[3]).startswith(cookie_path or "/")

    def run_notebook(self, kernel_id: str, path) -> list[str]:
        """Run every code cell of the notebook at ``path``; one output text per cell."""
        nb = nbformat.read(path, as_version=4)
        return [self.execute(kernel_id, cell.source) for cell in nb.cells if cell.cell_type == "code"]


def execute_request(msg_id: str, code: str) -> dict:
    """A Jupyter messaging protocol 5.3 ``execute_request`` for the websocket's JSON form."""
    return {
        "header": {
            "msg_id": msg_id,
            "msg_type": "execute_request",
            "username": "test",
            "session": uuid.uuid4().hex,
            "version": "5.3",
        },
        "parent_header": {},
        "metadata": {},
        "content": {"code": code, "silent": False, "store_history": True, "allow_stdin": False},
        "channel": "shell",
        "buffers": [],
    }
