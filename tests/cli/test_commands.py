"""The `castwise` command line as a user runs it: exit codes, one-line errors, Ctrl-C, bounded
input, the terminal's width."""

from __future__ import annotations

import io
import os
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import click
import pytest

from castwise.cli import COMMANDS, main

SRC = Path(__file__).parent.parent.parent / "src"
LINT = Path(__file__).parent.parent / "lint" / "fixtures"
TRACEBACK = """\
Traceback (most recent call last):
  File "train.py", line 41, in <module>
    out = model(x)
RuntimeError: Input type (torch.cuda.FloatTensor) and weight type (torch.cuda.HalfTensor) should be the same
"""


def _limit_memory() -> None:  # a run that reads without bound fails fast instead of eating the machine
    resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))


def _cli(*args: str | Path, columns: int | None = None, **kw: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = str(SRC)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    if args[0] == "explain":  # torch-free: a memory cap is safe (torch's thread pools need more)
        kw["preexec_fn"] = _limit_memory
    return subprocess.run(
        [sys.executable, "-m", "castwise", *map(str, args)], capture_output=True, text=True, timeout=120, env=env, **kw
    )  # type: ignore[call-overload]


def test_unknown_subcommand_names_the_valid_ones() -> None:
    p = _cli("audti")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        f"Error: no such command 'audti'; valid commands: {', '.join(sorted(COMMANDS))}"
    )
    assert "audit, demo, explain, ledger, lint-config" in p.stderr


def test_every_subcommand_is_registered_and_loads_lazily() -> None:
    code = (
        "import sys\nfrom castwise.cli import cli, main\n"
        "assert main(['rules', 'CW101']) == 0\n"
        "print(sorted(m for m in sys.modules if m.startswith('castwise.cli.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    ).stdout
    assert out.strip().splitlines()[-1] == "['castwise.cli.rules']"  # only the command that ran
    assert {"audit", "demo", "explain", "lint-config", "rules"} <= set(COMMANDS)


def test_explain_caps_an_endless_file_and_stdin() -> None:
    p = _cli("explain", "/dev/zero")
    assert p.returncode == 2, p.stderr[-500:]
    assert p.stderr == (
        "castwise: error: /dev/zero: more than 4 MiB of input; castwise explain reads an error "
        "message, a traceback or the end of a log: pass the end (tail -n 300 train.log | "
        "castwise explain -)\n"
    )
    with open("/dev/zero", "rb") as zero:
        p = _cli("explain", "-", stdin=zero)
    assert p.returncode == 2 and p.stderr.startswith("castwise: error: stdin: more than 4 MiB of input")


def test_explain_reads_the_end_of_a_huge_log(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    with log.open("w") as fh:
        for step in range(120_000):  # ~6 MiB of progress lines, the error at the end
            fh.write(f"step {step} loss 0.31 lr 1e-4 grad_norm 3.2 tokens/s 12345\n")
        fh.write(TRACEBACK)
    p = _cli("explain", log)
    assert p.returncode == 0, p.stderr
    assert "MODEL_INPUT_DTYPE_MISMATCH" in p.stdout
    assert p.stderr == f"castwise: note: {log} is {log.stat().st_size / 2**20:.0f} MiB; reading its last 4 MiB\n"


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_exits_130_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "slow.py").write_text(
        textwrap.dedent("""
        import time

        def build():
            print("building", flush=True)
            time.sleep(120)
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "castwise", "audit", f"{tmp_path / 'slow.py'}:build"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # as a terminal starts it: a shell that runs the tests in the background ignores SIGINT
        # for its children, and Python then installs no KeyboardInterrupt handler at all
        preexec_fn=_sigint_default,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "building\n"
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err == "castwise: interrupted\n"


def test_an_unwritable_json_path_is_refused_before_the_audit(tmp_path: Path) -> None:
    marker = tmp_path / "built"
    (tmp_path / "model.py").write_text(
        textwrap.dedent(f"""
        import torch
        from torch import nn

        def build():
            open({str(marker)!r}, "w").close()
            return nn.Linear(2, 2), torch.randn(1, 2)
    """)
    )
    target = f"{tmp_path / 'model.py'}:build"
    p = _cli("audit", target, "--json", tmp_path / "no" / "such" / "report.json")
    assert p.returncode == 2
    assert p.stderr == (
        f"castwise: error: --json {tmp_path / 'no' / 'such' / 'report.json'}: no folder "
        f"'{tmp_path / 'no' / 'such'}'; create it or give another path\n"
    )
    p = _cli("audit", target, "--json", tmp_path)
    assert p.returncode == 2 and "is a folder; give a file path" in p.stderr
    assert not marker.exists()  # refused before the model was built
    for command in (["explain", "-"], ["lint-config", LINT / "simpletuner" / "story5.env"]):
        p = _cli(*command, "--json", tmp_path / "no" / "r.json", input=TRACEBACK)
        assert p.returncode == 2 and "no folder" in p.stderr, command


def test_a_huge_policy_is_not_echoed_back_whole(tmp_path: Path) -> None:
    marker = tmp_path / "built"
    (tmp_path / "model.py").write_text(
        f"def build():\n    open({str(marker)!r}, 'w').close()\n    raise SystemExit('never here')\n"
    )
    p = _cli("audit", f"{tmp_path / 'model.py'}:build", "--policy", "x" * 100_000)
    assert p.returncode == 2
    (line,) = p.stderr.splitlines()
    assert len(line) < 1000, len(line)  # the policy cut to its ends; the valid presets listed whole
    assert line.startswith("castwise: error: unknown precision 'xxxxxxxx")
    assert "xxxx' (100,000 characters); valid presets: --bf16, --fp16, 16, 16-mixed, 16-true" in line
    assert not marker.exists()  # the policy is checked before the model is built


def test_demo_prints_no_temporary_paths() -> None:
    from castwise.demo import _config_story, _Out

    stream = io.StringIO()
    assert _config_story(_Out(stream, 80))
    text = stream.getvalue()
    assert tempfile.gettempdir() not in text
    assert "MIXED_PRECISION=bf16 (config.env:3)" in text
    assert max(map(len, text.splitlines())) <= 80


def _widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.mark.parametrize("columns", [80, 100])
def test_output_follows_the_terminal_width(columns: int, tmp_path: Path) -> None:
    runs = {
        "rules": _cli("rules", columns=columns),
        "rule page": _cli("rules", "CW104", columns=columns),
        "lint-config": _cli("lint-config", "simpletuner/story5.env", columns=columns, cwd=LINT),
        "explain": _cli("explain", "-", input=TRACEBACK, columns=columns),
    }
    for name, p in runs.items():
        assert p.returncode in (0, 1), (name, p.stderr)
        assert _widest(p.stdout) <= columns, (name, _widest(p.stdout))
    assert _widest(runs["lint-config"].stdout) > columns - 10  # it uses the width it has
    assert _widest(_cli("rules", columns=200).stdout) <= 120  # clamped


def test_piped_output_is_100_columns_wide() -> None:
    p = _cli("lint-config", "simpletuner/story5.env", cwd=LINT)
    assert 90 < _widest(p.stdout) <= 100


def test_main_returns_the_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rules", "CW101"]) == 0
    assert main(["rules", "CW000"]) == 2
    assert "castwise: error: no rule 'CW000'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert main(["audit"]) == 2  # missing TARGET: a usage error


@click.command("exits")
@click.argument("code", type=int)
def _exiting_command(code: int) -> None:
    """A subcommand registered from outside castwise.cli that exits instead of returning."""
    sys.exit(code)


def test_an_external_subcommand_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(COMMANDS, "exits", (__name__, "_exiting_command"))
    assert main(["exits", "3"]) == 3
    assert main(["exits", "0"]) == 0


def test_audit_writes_an_html_report_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.html"
    code = main(["audit", "castwise.stories:build_encoder", "--mode", "train", "--html", str(out)])
    assert code == 0, capsys.readouterr()
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "encoder.layers.0" in page


def test_audit_refuses_an_unwritable_html_path_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["audit", "castwise.stories:build_encoder", "--html", str(tmp_path / "missing" / "r.html")])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_torchaos_import_deprecation_is_not_in_castwises_output(tmp_path: Path) -> None:
    """torch's pytree logs a deprecation per Enum torchao registers, on every import of torchao
    (transformers imports it): what this machine's torch prints for it alone, castwise's output
    leaves out."""
    (tmp_path / "target.py").write_text(
        "import torch, torchao\n\ndef build():\n    return torch.nn.Linear(4, 4), torch.randn(2, 4)\n"
    )
    alone = subprocess.run([sys.executable, "-c", "import torchao"], capture_output=True, text=True, check=True)
    noise = [line.split("] ", 1)[-1] for line in alone.stderr.splitlines() if "Enum subclass" in line]
    audited = _cli("audit", f"{tmp_path / 'target.py'}:build", "--mode", "eval")
    assert audited.returncode == 0, audited.stderr
    assert "Enum subclass" not in audited.stderr + audited.stdout
    assert not any(message in audited.stderr for message in noise)
