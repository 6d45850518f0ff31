"""What an entry point prints reaches a terminal that cannot write every character: under a non-UTF-8 locale
(LANG=en_US.ISO-8859-1; or PYTHONIOENCODING=ascii) stdout raised UnicodeEncodeError on the tables' marks (†, ±,
Δ, –), a sample's text or a path's é, after the work was done. Python's C/POSIX locale is not one: Python coerces
it to UTF-8 (PEP 538/540). Without torch: scripts.report and scripts.results import it."""

import sys

RAISING = ("strict", "surrogateescape")  # error handlers that raise on a character the encoding lacks


def replace_unencodable_output() -> None:
    """sys.stdout writes a character its encoding lacks as a backslash escape (``\\u2020``), as Python's stderr
    does already, instead of raising; a stream whose handler was chosen (PYTHONIOENCODING=ascii:replace) keeps it.
    For each entry point, first thing: the files it writes name their encoding (UTF-8) and are unchanged."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and getattr(stream, "errors", None) in RAISING and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
