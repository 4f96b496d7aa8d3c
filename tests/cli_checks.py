"""A command's error contract, checked the same way everywhere: exit 1 and exactly one line
`<prog>: error: ...` on stderr (progress bars aside) naming what was asked."""

from __future__ import annotations


def one_line_error(capsys, main, prog: str, argv: list[str], *needles: str) -> str:
    capsys.readouterr()
    assert main(argv) == 1
    # a progress bar redraws its line after "\r": what a terminal keeps of a line is what follows the last one
    err = [kept for line in capsys.readouterr().err.split("\n") if (kept := line.rsplit("\r", 1)[-1]).strip()]
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: ") and all(n in err[0] for n in needles), err
    return err[0]
