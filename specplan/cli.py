"""The `plan` command: parse, call a library function, print. Bad input ends with one stderr line and exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specplan.errors import UserError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specplan")
def cli() -> None:
    """Profile, plan and run lossless speculative decoding on the hardware at hand."""


@cli.group()
def solve() -> None:
    """Turn a profile and acceptance statistics into a plan file."""


@solve.command("sequoia")
@click.option("--acceptance", "acceptance_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="acceptance/sequoia YAML (the positional acceptance vector)")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path),
              help="profile/latency YAML; without it the plan maximises tokens per step")
@click.option("--max-size", type=int, required=True, help="largest tree size n (nodes, root included)")
@click.option("--max-depth", type=int, required=True, help="largest tree depth d (draft steps)")
@click.option("--batch", type=int, default=1, show_default=True, help="sequences per batch: cost uses t(batch * n)")
@click.option("--context", type=int, default=None, help="use the profile's t(n) at this context length")
@click.option("--top", type=int, default=10, show_default=True, help="rows of the ranked table to print")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True)
def solve_sequoia_cmd(acceptance_path: Path, profile_path: Path | None, max_size: int, max_depth: int, batch: int,
                      context: int | None, top: int, output: Path) -> None:
    """Sequoia: the optimal token tree and its size/depth for this hardware."""
    from planner.sequoia import solve_sequoia
    from specplan.plan_schema import save_plan

    plan, ranked = solve_sequoia(acceptance_path, max_size, max_depth, profile_path, batch, context)
    header = f"{'n':>5} {'d':>3} {'G(n,d)':>8}"
    if profile_path is not None:
        header += f" {'step ms':>9} {'speedup':>8} {'tok/s':>8}"
    click.echo(header)
    for c in ranked[:top]:
        row = f"{c.size:>5} {c.depth:>3} {c.tokens_per_step:>8.4f}"
        if c.speedup is not None:
            row += f" {c.step_seconds * 1e3:>9.3f} {c.speedup:>8.3f} {c.tokens_per_second:>8.2f}"
        click.echo(row)
    save_plan(plan, output)
    click.echo(f"DP over n <= {max_size}, d <= {max_depth}: {plan.solver['seconds'] * 1e3:.1f} ms; "
               f"chose n = {plan.tree.size}, d = {plan.tree.depth}; wrote {output}")


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="also draw a PNG")
def show(file: Path, plot: Path | None) -> None:
    """Print a plan, profile or acceptance file readably."""
    from specplan.show import show_file

    click.echo(show_file(file, plot))
    if plot is not None:
        click.echo(f"wrote {plot}")


@cli.command()
@click.argument("plan_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["sequoia", "medusa", "vllm", "trtllm"]), required=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="write here instead of stdout")
def export(plan_file: Path, fmt: str, output: Path | None) -> None:
    """Export a Sequoia plan's tree to another engine's format."""
    from planner.export import export_tree
    from specplan.fileio import atomic_output
    from specplan.plan_schema import load_plan

    plan = load_plan(plan_file)
    if plan.tree is None:
        raise UserError(f"{plan_file}: a {plan.kind} has no token tree to export")
    text = export_tree(plan.tree, fmt)
    if output is None:
        click.echo(text)
    else:
        with atomic_output(output) as handle:
            handle.write(text + "\n")


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="plan", standalone_mode=False)
    except UserError as exc:
        click.echo(f"plan: error: {exc}", err=True)
        return 2
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        click.echo(f"plan: error: {exc.format_message()}", err=True)
        return 2
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("plan: interrupted", err=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
