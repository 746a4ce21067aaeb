"""The command line every page generator shares: print the page, or write it with --write."""

import argparse
import pathlib

DOCS = pathlib.Path(__file__).resolve().parents[1]


def page_main(doc: str, filename: str, page) -> None:
    """Parse ``--write``; write ``page()`` to docs/``filename`` or print it."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"write docs/{filename}")
    text = page()
    if p.parse_args().write:
        (DOCS / filename).write_text(text)
        print(f"wrote docs/{filename}")
    else:
        print(text)
