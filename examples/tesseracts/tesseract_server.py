"""Serve a ``tesseract_api.py`` over HTTP on 127.0.0.1 for as long as needed.

``Server(api_path).start()`` runs ``tesseract-runtime serve`` (from the
running Python's environment) on a free loopback port and waits for its
health endpoint; ``stop()`` ends it. Used by the example, the tests and the
benchmark of smartvjp.tesseract; as a context manager it stops on exit.
The served module imports smartvjp from this checkout (its root is put first
on the server's ``PYTHONPATH``), as the client does; the server's own output
goes to ``serve.log`` in the run folder, whose end a failed start reports.
"""

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]   # this checkout


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Server:
  """One ``tesseract-runtime serve`` process; ``env`` adds to its environment,
  ``runs`` is where it writes its run logs (default: a temporary folder)."""

  def __init__(self, api_path, env=None, port=None, runs=None):
    self.api_path = pathlib.Path(api_path).resolve()
    self.env = dict(env or {})
    self.runs = runs
    self.port = port or free_port()
    self.proc = None

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def start(self, timeout: float = 60.0) -> "Server":
    from tesseract_core import Tesseract
    runtime = pathlib.Path(sys.executable).with_name("tesseract-runtime")
    if self.runs is None:
      self.runs = tempfile.mkdtemp(prefix="tesseract_runs_")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                           if p)
    env = dict(os.environ, TESSERACT_API_PATH=str(self.api_path),
               TESSERACT_OUTPUT_PATH=str(self.runs), PYTHONPATH=path,
               **self.env)
    self.serve_log = pathlib.Path(self.runs) / "serve.log"
    with open(self.serve_log, "ab") as out:
      self.proc = subprocess.Popen(
          [str(runtime), "serve", "--host", "127.0.0.1", "--port",
           str(self.port)], env=env, cwd=str(self.runs), stdout=out,
          stderr=subprocess.STDOUT)
    client = Tesseract.from_url(self.url, timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
      try:
        client.health()
        return self
      except Exception:  # noqa: BLE001 - not up yet
        if time.monotonic() > deadline or self.proc.poll() is not None:
          self.stop()
          tail = self.serve_log.read_text(errors="replace").splitlines()[-15:]
          raise RuntimeError(
              f"tesseract-runtime serve did not start on {self.url}; the "
              f"end of its output ({self.serve_log}):\n"
              + "\n".join(tail)) from None
        time.sleep(0.1)

  def stop(self) -> None:
    if self.proc is not None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
      self.proc = None

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.stop()
