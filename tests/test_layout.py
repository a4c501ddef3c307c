"""The package's layout, as docs/design.md describes it: imports flow one way (kernels <- index/cache <- policy <-
drafter <- batch <- loop <- assistant / reformat / serve / cli; serve's scheduler <- its engine), and the drafting
core needs neither torch nor transformers."""

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lookupdec"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict:
    """module -> the lookupdec modules it imports (at any depth of its code, lazy imports included)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [f"{target}.{alias.name}" for alias in node.names]
                deps.update(n for n in names if n in modules)
                deps.add(target)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d not in (name, "lookupdec")}
    return graph


def test_imports_have_no_cycle():
    graph = _imports()
    assert {"lookupdec.drafter", "lookupdec.loop", "lookupdec.serve.scheduler", "lookupdec.cli"} <= set(graph)
    state = {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            assert state.get(dep) != "open", "import cycle: " + " -> ".join(path + [dep])
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


@pytest.mark.parametrize("low, high", [
    ("lookupdec.drafter", "lookupdec.assistant"), ("lookupdec.drafter", "lookupdec.verify"),
    ("lookupdec.policy", "lookupdec.drafter"), ("lookupdec.loop", "lookupdec.reformat.engine"),
    # The batch's mechanics know neither the loop that drives them for generate() nor the server's scheduler.
    ("lookupdec.batch", "lookupdec.loop"), ("lookupdec.batch", "lookupdec.serve.scheduler"),
    ("lookupdec.loop", "lookupdec.serve.scheduler"), ("lookupdec.serve.scheduler", "lookupdec.serve.engine"),
    ("lookupdec.batch", "lookupdec.serve.engine"), ("lookupdec.serve.protocol", "lookupdec.serve.engine"),
    ("lookupdec.serve.engine", "lookupdec.serve.app"),
    # The vLLM room rides on the drafter and the server's wire format, never on our own engine.
    ("lookupdec.vllm.proposer", "lookupdec.batch"), ("lookupdec.vllm.proposer", "lookupdec.loop"),
    ("lookupdec.vllm.proposer", "lookupdec._transformers"), ("lookupdec.vllm.middleware", "lookupdec._transformers"),
    ("lookupdec.vllm.middleware", "lookupdec.serve.app"), ("lookupdec.drafter", "lookupdec.vllm.proposer"),
])
def test_lower_layers_do_not_import_higher_ones(low, high):
    graph = _imports()
    assert {low, high} <= set(graph)
    reach, todo = set(), [low]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in reach:
                reach.add(dep)
                todo.append(dep)
    assert high not in reach


def test_the_drafting_core_imports_neither_torch_nor_transformers():
    code = ("import sys, lookupdec.drafter, lookupdec.policy, lookupdec.cache, lookupdec.index; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_vllm_room_loads_without_torch_transformers_or_vllm():
    # vLLM imports the proposer in its worker and the middleware in its server; neither pulls more than it needs
    # (vLLM itself and transformers' tokenizer are imported when used).
    code = ("import sys, lookupdec.vllm.proposer, lookupdec.vllm.middleware; "
            "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_library_and_its_command_load_without_the_server_extra():
    # fastapi and uvicorn come with the serve extra: only `lookupdec serve` may import them, when it runs. The wire
    # format module is plain data.
    code = ("import sys, lookupdec, lookupdec.cli, lookupdec.serve.protocol; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_untested_transformers_versions_fail_clearly(monkeypatch):
    from lookupdec import _transformers

    for fine in ("5.24.0", "5.30.1", "5.99.0.dev0"):
        _transformers._check_version(fine)
    monkeypatch.delenv("LOOKUPDEC_ALLOW_UNTESTED_TRANSFORMERS", raising=False)
    for untested in ("6.0.0", "5.17.0", "4.57.1"):
        with pytest.raises(ImportError, match=rf"needs transformers >=5.24,<6 .*found {untested}"):
            _transformers._check_version(untested)
    monkeypatch.setenv("LOOKUPDEC_ALLOW_UNTESTED_TRANSFORMERS", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _transformers._check_version("6.0.0")
    assert any("continuing" in str(w.message) for w in caught)


def test_product_tests_import_no_benchmark_or_research_code():
    # Tests assert what the library does; the studies and benchmarks test themselves (benchmarks/, research/).
    tests = Path(__file__).resolve().parent
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0] in ("benchmarks", "research")]
    assert tests.name == "tests" and len(list(tests.glob("test_*.py"))) > 10  # the walk found the suite
    assert offenders == []
