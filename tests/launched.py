"""A command a test starts (`dtm launch ...`), its output lines read on a thread as they
come, so that a test can wait for a line while the command runs: tests/test_elastic.py and
tests/ray_launch_script.py."""

from __future__ import annotations

import queue
import re
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence


class Launched:
    """`argv` running, stdout and stderr together in `lines`."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None):
        self.p = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(env), cwd=cwd)
        self.lines: list[str] = []
        self._new: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line)
            self._new.put(line)

    def match(self, pattern: str, timeout: float) -> re.Match:
        """The first line of the output that regex `pattern` matches, waiting up to `timeout`
        s for it; AssertionError with the last lines when none comes."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            while seen < len(self.lines):
                m = re.search(pattern, self.lines[seen])
                seen += 1
                if m:
                    return m
            if time.monotonic() >= deadline or (not self._reader.is_alive() and seen == len(self.lines)):
                break
            try:
                self._new.get(timeout=0.2)
            except queue.Empty:
                pass
        raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n" + "".join(self.lines[-60:]))

    def finish(self, timeout: float) -> int:
        """Its exit status, once it ended and its last lines were read; AssertionError (it is
        killed) when it runs past `timeout` s."""
        try:
            code = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError("the command did not end in time:\n" + "".join(self.lines[-60:])) from None
        self._reader.join(5.0)
        return code
