"""`python -m sparserl.report RUN_DIR [--out FILE] [--max-steps N]`: write RUN_DIR/report.html (see __init__.py)."""
from __future__ import annotations

import argparse
import sys

from sparserl.utils.errors import UserError, run_main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sparserl.report",
                                     description="Write one self-contained HTML report (curves + sample viewer) of a run.")
    parser.add_argument("run_dir", help="a run's trainer.output_dir (holds metrics.jsonl, samples/), or a folder of "
                                        "runs such as outputs/grpo (its newest run, the one its latest points to)")
    parser.add_argument("--out", default=None, help="where to write the page (default: RUN_DIR/report.html)")
    parser.add_argument("--max-steps", type=int, default=40,
                        help="logged steps put on the page, evenly spaced when there are more (default: 40)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    def run() -> None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("the report draws its curves with matplotlib: pip install matplotlib "
                            "(or pip install -e \".[report]\")") from None
        from sparserl.report.page import build_report

        print(build_report(args.run_dir, args.out, args.max_steps))

    run_main(run)


if __name__ == "__main__":
    main()
