"""The README is part of the product: its commands must be the ones CI runs, and its code must run."""

import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    # .ci/run extracts the command from the README with this same pattern; it must find exactly one.
    out = subprocess.run(
        ["sed", "-n", r"s/^    \(python3 -m venv .venv && .venv\/bin\/pip install .*pytest.*\)$/\1/p", "README.md"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert len(out) == 1, out
    assert out[0].endswith("python -m pytest -q -n 2")


# The README and every page of docs/: each Python block runs as written, in a fresh namespace (a reader pastes one
# block at a time), with a preset in place of a checkpoint path and a temporary directory for what it writes.
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def _python_blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)


@pytest.mark.parametrize("doc", DOCS)
def test_python_examples_run(doc):
    blocks = _python_blocks(doc)
    assert blocks or doc != "README.md", "the README should show code"
    for block in blocks:
        exec(compile(block, doc, "exec"), {})


def _recipe():
    spec = importlib.util.spec_from_file_location("deepseek_pretrain", ROOT / "recipes" / "deepseek_pretrain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generic_recipe():
    spec = importlib.util.spec_from_file_location("pretrain", ROOT / "recipes" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recipe_commands(script: str = "recipes/deepseek_pretrain.py") -> list[tuple[str, list[str]]]:
    """(XLA_FLAGS or '', arguments) of every command of recipe ``script`` in the README's bash blocks."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True)
            if script in words:
                flags = next((w.split("=", 1)[1] for w in words if w.startswith("XLA_FLAGS=")), "")
                commands.append((flags, words[words.index(script) + 1:]))
    return commands


def test_readme_plan_excerpt_is_what_plan_prints(capsys):
    # Each run of lines between "..." appears, in that order and contiguously, in the real --plan output.
    section = README[README.index("What `--plan` prints"):]
    excerpt = re.search(r"```\n(.*?)```", section, flags=re.S).group(1)
    assert _recipe().main(["--model", "deepseek3-671b", "--mesh", "fsdp=64,expert=8", "--plan"]) == 0
    printed = "\n" + capsys.readouterr().out
    position = 0
    for chunk in excerpt.split("...\n"):
        assert chunk.strip(), "an excerpt chunk is empty"
        found = printed.find(chunk if chunk.startswith("\n") else "\n" + chunk, position)
        assert found >= 0, f"the README's --plan excerpt shows lines --plan does not print (in this order):\n{chunk}"
        position = found + len(chunk)


def test_readme_recipe_commands_get_their_own_run_dirs_and_devices():
    import math

    from nnx_zoo import DeepSeekV3Config
    from nnx_zoo.models.deepseek import PRESETS
    from nnx_zoo.sharding import RULE_SETS

    recipe = _recipe()
    parser = recipe.build_parser(DeepSeekV3Config, presets=PRESETS)
    commands = _recipe_commands()
    assert len(commands) >= 4
    run_dirs = []
    for flags, argv in commands:
        args = parser.parse_args(argv)
        assert args.model in PRESETS and args.rules in RULE_SETS, argv
        if args.plan:  # each plan runs (deepseek3-671b's in the excerpt test)
            if args.model != "deepseek3-671b":
                assert recipe.main(argv) == 0, argv
            continue
        run_dirs.append(args.run_dir or f"runs/{args.model}")
        devices = math.prod(args.mesh.values())
        if devices > 1:  # a fixed mesh: the command makes that many CPU devices itself
            assert f"--xla_force_host_platform_device_count={devices}" in flags, argv
    # "runs/deepseek3-tiny" is the main job's (command 1): another model there would fail to resume from it
    assert "runs/deepseek3-tiny" not in run_dirs and len(set(run_dirs)) == len(run_dirs), run_dirs


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_with_meshes_make_their_devices(doc):
    # Pasted into a fresh interpreter, a block with a mesh makes its fake CPU devices itself, before jax is imported.
    for block in _python_blocks(doc):
        if "make_mesh(" in block:
            setup = re.search(r'^os\.environ\["XLA_FLAGS"\] = .*--xla_force_host_platform_device_count=\d+', block,
                              flags=re.M)
            first_import = re.search(r"^(from|import) (jax|flax|nnx_zoo)", block, flags=re.M)
            assert setup and first_import and setup.start() < first_import.start(), block[:200]


def test_readme_shell_commands_run_in_the_venv_and_the_test_time_is_stated():
    # After the install command only .venv/bin/python has the packages: a bare `python` fails (no module 'jax').
    commands = [line for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S)
                for line in block.replace("\\\n", " ").splitlines() if not line.lstrip().startswith("#")]
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    commands += [span for span in re.findall(r"`([^`\n]+)`", prose) if re.search(r"\bpython3? ", span)]
    for command in commands:
        for word in shlex.split(command):
            if re.fullmatch(r"(\S*/)?python3?", word) and not command.startswith("python3 -m venv"):
                assert word == ".venv/bin/python", command
    assert re.search(r"about \d+-\d+ minutes on 2 cores", README)


def test_docs_point_only_inside_the_repository():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        assert "../shared" not in text and "DESIGN" not in text, path
        for target in re.findall(r"`((?:docs|benchmarks|recipes|nnx_zoo|tests)/[\w./-]+\.(?:md|py|ipynb))`", text):
            assert (ROOT / target).exists(), f"{path.name} names {target}, which does not exist"


def test_readme_generic_recipe_commands_parse_and_plan(capsys):
    import math

    from nnx_zoo.sharding import RULE_SETS

    recipe = _generic_recipe()
    commands = _recipe_commands("recipes/pretrain.py")
    assert len(commands) >= 3
    python = "".join(re.findall(r"```python\n(.*?)```", README, flags=re.S))
    for flags, argv in commands:
        if "--from-pretrained" in argv:  # a checkpoint that a README Python block writes
            directory = argv[argv.index("--from-pretrained") + 1]
            assert f'save_pretrained("{directory}")' in python, directory
            continue
        source = recipe.model_source(argv)
        args = recipe.build_parser(source.config_cls, entry=recipe.GENERIC).parse_args(argv)
        assert args.rules in RULE_SETS, argv
        if args.plan:
            assert recipe.main(argv) == 0, argv
            assert "parameters" in capsys.readouterr().out
            continue
        devices = math.prod(args.mesh.values())
        if devices > 1:
            assert f"--xla_force_host_platform_device_count={devices}" in flags, argv
    run_dirs = [a[a.index("--run-dir") + 1] if "--run-dir" in a else None for _, a in
                [*_recipe_commands(), *commands]]
    named = [d for d in run_dirs if d]
    assert len(set(named)) == len(named), named


def test_readme_family_table_names_tests_that_exist():
    section = README[README.index("## Families"):README.index("## Pretraining")]
    cells = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", section)
    assert len(cells) >= 18, cells  # six features x three families
    for path, name in cells:
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), flags=re.M), f"{path}::{name}"
