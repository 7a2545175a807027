"""A progress bar while weights load: the model reads its tensors from the checkpoint one by one
(dequantizing GGUF blocks, converting dtypes), and this mapping counts the reads. On a terminal
it redraws one line on stderr; otherwise it logs every quarter.
"""
import logging
import sys
import time
from collections.abc import Mapping

log = logging.getLogger("tensorfold.models")
WIDTH = 30


class LoadProgress(Mapping):
    def __init__(self, tensors: Mapping, label: str = "loading weights", stream=None):
        self._tensors = tensors
        self._seen: set[str] = set()
        self._label = label
        self._stream = stream or sys.stderr
        self._tty = hasattr(self._stream, "isatty") and self._stream.isatty()
        self._quarter = 0
        self._started = time.perf_counter()

    def __getitem__(self, name):
        value = self._tensors[name]
        if name not in self._seen:
            self._seen.add(name)
            self._report()
        return value

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self):
        return len(self._tensors)

    def __contains__(self, name):
        return name in self._tensors

    def _report(self) -> None:
        done, total = len(self._seen), max(len(self._tensors), 1)
        if self._tty:
            filled = WIDTH * done // total
            self._stream.write(f"\r{self._label} [{'#' * filled}{'.' * (WIDTH - filled)}] "
                               f"{100 * done // total:3d}% ({done}/{total})")
            if done >= total:
                self._stream.write(f" {time.perf_counter() - self._started:.1f}s\n")
            self._stream.flush()
        elif 4 * done // total > self._quarter:
            self._quarter = 4 * done // total
            log.info("%s: %d%% (%d/%d tensors)", self._label, 100 * done // total, done, total)

    def finish(self) -> None:
        """End the bar's line if the model read fewer tensors than the checkpoint holds."""
        if self._tty and len(self._seen) < len(self._tensors):
            self._stream.write("\n")
            self._stream.flush()
