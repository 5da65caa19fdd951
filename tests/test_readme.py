"""The README is a newcomer's first screen and docs/ holds the depth (issue 16).

Checked here: the README's size and first screen, its two commands (the second one is what .ci/run runs),
that its ten-line example trains, that its policy table and docs/policies.md list every preset with the
bytes/param the engine really allocates, and that every relative link in README.md and docs/*.md resolves.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.programs.bench.measure import state_bytes

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_CHARS = 15_000
FIRST_SCREEN_LINES = 50  # the commands, the example and the headline results table fit in this many lines

# every topic issue 16 names has its own page, linked from the README
TOPIC_PAGES = ("policies.md", "engine.md", "safety.md", "inspector.md", "fp8.md", "distributed.md",
               "huggingface.md", "bench.md", "cli.md", "architecture.md", "limitations.md", "loops.md", "README.md")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced code block, in order."""
    return re.findall(r"^```([\w-]*)\n(.*?)^```", text, re.S | re.M)


def _commands(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _ci_test_command() -> str:
    lines = [line for line in _text(ROOT / ".ci" / "run").splitlines() if line.strip() and not line.startswith("#")]
    return lines[-1]


def _without_quiet(command: str) -> str:
    return command.replace("pip install -q ", "pip install ")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _headings(path: Path) -> set[str]:
    body = re.sub(r"^```.*?^```", "", _text(path), flags=re.S | re.M)
    return {_slug(m) for m in re.findall(r"^#{1,6} +(.+?) *$", body, re.M)}


def _links(path: Path) -> list[str]:
    """Link targets outside code blocks and inline code."""
    body = re.sub(r"^```.*?^```", "", _text(path), flags=re.S | re.M)
    body = re.sub(r"`[^`\n]*`", "", body)
    return re.findall(r"\]\(([^)\s]+)\)", body)


def _table_rows(text: str, first_header: str) -> dict[str, list[str]]:
    """The rows of the Markdown table whose header's first cell is ``first_header``: name -> cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"^\| *{re.escape(first_header)} *\|", line))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells
    return rows


def test_readme_is_short():
    assert len(_text(README)) < MAX_CHARS


def test_first_screen_holds_the_commands_the_example_and_the_results():
    lines = _text(README).splitlines()[:FIRST_SCREEN_LINES + 1]  # one more: the line after the screen's last
    head = "\n".join(lines[:FIRST_SCREEN_LINES])
    languages = [lang for lang, _ in _fenced_blocks(head)]
    assert languages[:2] == ["bash", "python"], languages
    assert "## Results on this machine" in head
    results = head.split("## Results on this machine", 1)[1]
    rows = [line for line in results.splitlines() if line.startswith("| ")]
    assert rows and rows[0].startswith("| row |") and "vs torch-autocast" in rows[0]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["fp32", "bf16-mixed", "bf16-pure", "bf16-kahan", "bf16-sr",
                                                           "torch-autocast (peer)"]
    # the table is complete inside the first screen: the line after it is blank
    last = max(i for i, line in enumerate(lines) if line.startswith("| torch-autocast (peer) |"))
    assert last < FIRST_SCREEN_LINES and not lines[last + 1].strip()


def test_first_command_runs_the_bench_and_second_is_what_ci_runs():
    lang, block = _fenced_blocks(_text(README))[0]
    assert lang == "bash"
    commands = _commands(block)
    assert len(commands) == 2, commands
    assert commands[0].rstrip().endswith(".venv/bin/mixprec bench")
    # .ci/run runs the README's test command, only quieter (pip's -q): the same steps, nothing else
    assert commands[1] == _without_quiet(_ci_test_command())


def test_readme_example_trains(monkeypatch, tmp_path):
    blocks = [body for lang, body in _fenced_blocks(_text(README)) if lang == "python"]
    code = blocks[0]
    assert len(_commands(code)) <= 12, "the README's example is meant to be about ten lines"
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "readme_example"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md example", "exec"), scope)
    result, loss = scope["result"], scope["loss"]
    assert isinstance(result, mixprec.StepResult) and result.applied and result.step == 100
    assert loss.item() < 2.0, f"the example did not train: final loss {loss.item()}"  # starts near 32
    assert "auto" in out.getvalue()


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def test_policy_tables_list_every_preset():
    expected = set(mixprec.PRESETS) | {"auto"}
    readme = _table_rows(_text(README), "preset")
    docs = _table_rows(_text(DOCS / "policies.md"), "preset")
    assert set(readme) == expected
    assert set(docs) == expected
    for name, preset in mixprec.PRESETS.items():
        # docs/policies.md: | preset | params | compute | fp32 master | update rounding | loss scale | bytes/param |
        _, params, compute, master, rounding, loss_scale, per_param = docs[name]
        assert params == _dtype_name(preset.param_dtype), name
        assert compute.startswith(_dtype_name(preset.compute_dtype)), name
        assert (master == "yes") == (preset.master_dtype is not None), name
        assert rounding.lower().startswith({"nearest": "nearest", "kahan": "kahan", "stochastic": "stochastic"}[
            preset.rounding]), name
        assert loss_scale == str(preset.loss_scale), name
        assert ("fp8" in compute) == (preset.fp8 is not None), name
        assert readme[name][2] == per_param, f"{name}: README and docs/policies.md disagree on bytes/param"


def _measured_bytes_per_param(policy: str) -> float:
    torch.manual_seed(0)
    # bias-free 64 x 64 linears: every tensor has 4096 elements and 2 dims, so 8-bit state (bf16-lean) codes
    # all of them, as it does the large tensors of a real model (smaller and 1-D ones keep fp32 state)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(64, 64, bias=False), torch.nn.GELU(), torch.nn.Linear(64, 64, bias=False))
    opt = mixprec.optim.AdamW(model.parameters(), lr=1e-3)
    mp = mixprec.MixedPrecision(model, opt, policy=policy)
    for step in range(2):
        x = mp.cast_inputs(torch.randn(8, 64))
        with mp.autocast():
            loss = mp.model(x).float().pow(2).mean()
        mp.backward(loss)
        if step == 1:  # between backward and step, as the bench reads it: gradients and optimizer state exist
            return state_bytes(mp.model, opt).per_param
        mp.step()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("name", sorted(mixprec.PRESETS))
def test_policy_table_bytes_per_param_are_measured(name):
    cell = _table_rows(_text(README), "preset")[name][2]
    numbers = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", cell)]
    assert _measured_bytes_per_param(name) == pytest.approx(numbers[0], abs=0.005)   # the cell's 2 decimals
    if "state=bf16" in cell:  # e.g. "14 (10 with `state=bf16`)"
        assert _measured_bytes_per_param(f"{name},state=bf16") == numbers[1]


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        assert dest.exists(), f"{path.name}: link to {target!r} does not resolve"
        if anchor:
            assert dest.suffix == ".md" and anchor in _headings(dest), f"{path.name}: no heading for {target!r}"


def test_readme_links_every_topic_page_and_the_index_lists_every_doc():
    readme_links = {t.partition("#")[0] for t in _links(README)}
    for page in TOPIC_PAGES:
        assert f"docs/{page}" in readme_links, f"README does not link docs/{page}"
    index_links = {t.partition("#")[0] for t in _links(DOCS / "README.md")}
    for doc in DOCS.glob("*.md"):
        if doc.name != "README.md":
            assert doc.name in index_links, f"docs/README.md does not list {doc.name}"


_RUN_ROW = re.compile(r"^\| (\d{4}-\d\d-\d\d) \| `([0-9a-f]{7,})` \| (2-core [^|]+?) \| `(mixprec bench[^`]*)` \| (\d+) \|$")


def _recorded_runs() -> list[tuple[str, str, int]]:
    """docs/results-history.md's "Bench wall time" table: (machine, command, wall s), oldest first."""
    text = (DOCS / "results-history.md").read_text()
    return [(m[3], m[4], int(m[5])) for m in map(_RUN_ROW.match, text.splitlines()) if m]


def test_the_readme_runtime_claims_are_the_last_recorded_runs():
    """Issue 36: the README said "5 min on a 2-core Xeon" for a run that took 23. Every "N min on a 2-core X" and
    "`--quick`: N s on a 2-core X" in the first command's comment is the last run of that command on that machine in
    docs/results-history.md's "Bench wall time" table (minutes rounded to the nearest, seconds to the nearest 10)."""
    comment = README.read_text().split("```bash", 1)[1].splitlines()[1]
    runs = _recorded_runs()
    assert runs, "docs/results-history.md has no Bench wall time rows"
    claims = [("mixprec bench", int(n), machine.strip()) for n, machine in re.findall(r"(\d+) min on a (2-core [^;,)]+)", comment)]
    claims += [("mixprec bench --quick", int(n), machine.strip())
               for n, machine in re.findall(r"`--quick`: (\d+) s on a (2-core [^;,)]+)", comment)]
    assert claims, comment
    for command, claimed, machine in claims:
        walls = [wall for m, c, wall in runs if m == machine and c == command]
        assert walls, f"no recorded `{command}` run on a {machine}"
        measured = round(walls[-1] / 60) if command == "mixprec bench" else round(walls[-1], -1)
        assert claimed == measured, (command, machine, claimed, walls[-1])
