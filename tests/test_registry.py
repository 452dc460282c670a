"""Backend selection: explicit name, environment, priority, plugins, and the errors a user sees."""

from __future__ import annotations

import sys
import types
from importlib.metadata import EntryPoint

import pytest

from offload_core import BackendUnavailableError, InvalidSpecError, UnknownBackendError, registry
from offload_core.backends.cpu import CpuBackend
from offload_core.testing.fake import FakeBackend
from offload_core.testing.fresh_registry import fresh_registry


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    with fresh_registry():
        yield


class Broken(FakeBackend):
    name = "broken"
    priority = 500
    install_hint = "pip install broken-sdk"

    @classmethod
    def probe(cls):
        return "the broken SDK is not installed"


class Fast(FakeBackend):
    name = "fast"
    priority = 200


def test_builtins_are_listed_without_importing_them():
    assert set(registry.backend_names()) >= {"cpu", "cuda", "npu", "xpu"}


def test_availability_gives_a_reason_for_every_unusable_backend():
    avail = registry.availability()
    assert avail["cpu"] is None
    for name in ("cuda", "npu", "xpu"):
        assert avail[name] is None or isinstance(avail[name], str) and avail[name]


def test_explicit_name_then_environment_then_priority(monkeypatch):
    registry.register_backend("fast", Fast)
    assert registry.get_backend().name == "fast"  # highest usable priority
    monkeypatch.setenv(registry.ENV_BACKEND, "cpu")
    assert isinstance(registry.get_backend(), CpuBackend)
    assert registry.get_backend("fast").name == "fast"  # explicit beats the environment


def test_unusable_backends_are_passed_over_in_automatic_selection():
    registry.register_backend("broken", Broken)
    registry.register_backend("fast", Fast)
    assert registry.select_backend_name() == "fast"


def test_instances_are_cached_per_device_index():
    a, b, c = registry.get_backend("cpu"), registry.get_backend("cpu"), registry.get_backend("cpu", device_index=1)
    assert a is b and a is not c and c.device_index == 1


def test_unknown_name_lists_the_known_ones(monkeypatch):
    monkeypatch.setenv(registry.ENV_PLUGINS, "0")  # the built-ins only, whatever plugins are installed
    with pytest.raises(UnknownBackendError, match="unknown offload backend 'tpu'.*cpu, cuda, npu, xpu") as info:
        registry.get_backend("tpu")
    assert isinstance(info.value, LookupError)
    monkeypatch.setenv(registry.ENV_BACKEND, "tpu")
    with pytest.raises(UnknownBackendError):
        registry.get_backend()


def test_unavailable_name_carries_reason_and_install_hint():
    registry.register_backend("broken", Broken)
    with pytest.raises(BackendUnavailableError) as info:
        registry.get_backend("broken")
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.name == "broken" and err.reason == "the broken SDK is not installed"
    assert "pip install broken-sdk" in str(err) and "OFFLOAD_CORE_BACKEND=cpu" in str(err)


def test_an_unavailable_backend_named_by_the_environment_says_so(monkeypatch):
    registry.register_backend("broken", Broken)
    monkeypatch.setenv("OFFLOAD_CORE_BACKEND", "broken")
    with pytest.raises(BackendUnavailableError, match=r"'broken' \(from \$OFFLOAD_CORE_BACKEND\) is unavailable"):
        registry.get_backend()
    monkeypatch.delenv("OFFLOAD_CORE_BACKEND")
    with pytest.raises(BackendUnavailableError, match="'broken' is unavailable"):  # named by the caller
        registry.get_backend("broken")


def test_a_backend_name_in_capitals_is_unknown_but_the_message_names_the_right_one():
    with pytest.raises(UnknownBackendError, match="did you mean 'cpu'"):
        registry.get_backend("CPU")


def test_register_refuses_to_clobber_unless_asked():
    class FastCpu(Fast):
        name = "cpu"

    with pytest.raises(ValueError, match="already registered"):
        registry.register_backend("cpu", FastCpu)
    registry.register_backend("cpu", FastCpu, clobber=True)
    assert isinstance(registry.get_backend("cpu"), FastCpu)
    with pytest.raises(ValueError, match="module:Class"):
        registry.register_backend("x", "no_colon_here")
    with pytest.raises(ValueError, match="Backend subclass"):
        registry.register_backend("x", object)


def test_lazy_string_is_imported_only_when_used(monkeypatch):
    module = types.ModuleType("lazy_plugin_mod")
    module.Plugin = Fast
    registry.register_backend("fast", "lazy_plugin_mod:Plugin")
    monkeypatch.setitem(sys.modules, "lazy_plugin_mod", module)
    assert registry.backend_class("fast") is Fast


def test_a_backend_is_named_by_its_key(monkeypatch):
    """Results, logs and the worker's messages name a backend by its class's `name`: a class
    under another key is refused, at registration or, for a lazy target, when loaded."""
    with pytest.raises(InvalidSpecError, match="backend Fast has name 'fast', not its key 'quick'"):
        registry.register_backend("quick", Fast)
    module = types.ModuleType("misnamed_plugin")
    module.Plugin = Fast
    monkeypatch.setitem(sys.modules, "misnamed_plugin", module)
    registry.register_backend("quick", "misnamed_plugin:Plugin")
    with pytest.raises(BackendUnavailableError, match="misnamed_plugin:Plugin has name 'fast', not its key 'quick'"):
        registry.get_backend("quick")


def test_a_backend_that_fails_to_import_is_unavailable_not_fatal(monkeypatch):
    monkeypatch.setenv(registry.ENV_PLUGINS, "0")  # no installed plugin may outrank the built-ins
    registry.register_backend("ghost", "no_such_module_anywhere:Ghost")
    reason = registry.availability()["ghost"]
    assert "cannot import no_such_module_anywhere:Ghost" in reason
    assert registry.get_backend().name in {"cpu", "cuda", "npu", "xpu"}
    with pytest.raises(BackendUnavailableError, match="cannot import"):
        registry.get_backend("ghost")


def test_entry_point_plugins_are_found(monkeypatch):
    module = types.ModuleType("third_party_offload")
    module.FastBackend = Fast
    monkeypatch.setitem(sys.modules, "third_party_offload", module)
    eps = [
        EntryPoint("fast", "third_party_offload:FastBackend", registry.ENTRY_POINT_GROUP),
        EntryPoint("cpu", "third_party_offload:FastBackend", registry.ENTRY_POINT_GROUP),  # cannot take a built-in name
    ]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    with fresh_registry():
        assert "fast" in registry.backend_names()
        assert registry.backend_class("cpu") is CpuBackend
        assert registry.get_backend().name == "fast"
    monkeypatch.setenv(registry.ENV_PLUGINS, "0")
    with fresh_registry():
        assert "fast" not in registry.backend_names()


def test_import_offload_core_loads_no_backend_or_device_sdk():
    import subprocess

    code = (
        "import sys, offload_core; "
        "bad = [m for m in sys.modules if m.startswith(('torch', 'offload_core.backends', 'triton', 'torch_npu'))]; "
        "print(bad); raise SystemExit(bool(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_bad_names_and_targets_are_offload_errors():
    from offload_core import InvalidSpecError, UnknownBackendError

    with pytest.raises(UnknownBackendError):
        registry.get_backend(["cpu"])
    with pytest.raises(InvalidSpecError, match="Backend subclass"):
        registry.register_backend("x", 5)
    for name in (None, "", "My NPU", "Cuda", "2x"):
        with pytest.raises(InvalidSpecError, match="lower-case letters"):
            registry.register_backend(name, "a:B")
    with pytest.raises(InvalidSpecError, match="clobber must be"):
        registry.register_backend("cpu", Fast, clobber="no")
    assert registry.backend_class("cpu") is CpuBackend


@pytest.mark.parametrize("index", [-1, True, 0.5, float("nan"), "0", None, [0]])
def test_a_device_index_that_is_no_integer_from_zero_is_refused_naming_it(index):
    from offload_core import InvalidSpecError

    with pytest.raises(InvalidSpecError, match="device_index must be an integer >= 0"):
        registry.get_backend("cpu", device_index=index)
    with pytest.raises(InvalidSpecError, match="device_index must be an integer >= 0"):
        CpuBackend(index)


def test_a_backend_class_that_leaves_the_contract_unimplemented_is_refused_or_unavailable(monkeypatch):
    from offload_core import InvalidSpecError
    from offload_core.backend import Backend

    class Incomplete(Backend):  # forgot copy_batch and the rest
        name = "incomplete"
        priority = 900

        @classmethod
        def probe(cls):
            return None

    with pytest.raises(InvalidSpecError, match="does not implement the abstract method"):
        registry.register_backend("incomplete", Incomplete)
    with pytest.raises(InvalidSpecError, match="does not implement"):
        registry.register_backend("abs", Backend)
    module = types.ModuleType("incomplete_plugin")
    module.Incomplete = Incomplete
    monkeypatch.setitem(sys.modules, "incomplete_plugin", module)
    registry.register_backend("incomplete", "incomplete_plugin:Incomplete")  # lazy: found out when loaded
    assert "does not implement" in registry.availability()["incomplete"]
    assert registry.select_backend_name() != "incomplete"


def test_entry_points_load_as_importlib_loads_them(monkeypatch):
    """A nested attribute and extras are entry-point syntax: the backend loads; a module alone
    is no Backend subclass, and a malformed name is ignored."""
    nested, extras = (type(n.title(), (Fast,), {"name": n}) for n in ("nested", "extras"))
    module = types.ModuleType("nested_plugin")
    module.Outer = types.SimpleNamespace(Inner=nested, Extras=extras)
    monkeypatch.setitem(sys.modules, "nested_plugin", module)
    eps = [
        EntryPoint("nested", "nested_plugin:Outer.Inner", registry.ENTRY_POINT_GROUP),
        EntryPoint("extras", "nested_plugin:Outer.Extras [gpu]", registry.ENTRY_POINT_GROUP),
        EntryPoint("modonly", "nested_plugin", registry.ENTRY_POINT_GROUP),
        EntryPoint("", "nested_plugin:Outer.Inner", registry.ENTRY_POINT_GROUP),
        EntryPoint("Upper", "nested_plugin:Outer.Inner", registry.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    with fresh_registry():
        assert registry.backend_class("nested") is nested and registry.backend_class("extras") is extras
        assert "not a Backend subclass" in registry.availability()["modonly"]
        assert "" not in registry.backend_names() and "Upper" not in registry.backend_names()


@pytest.mark.parametrize("answer", [False, "", 0])
def test_a_probe_that_answers_neither_none_nor_a_reason_is_named(answer):
    class Odd(FakeBackend):
        name = "odd"

        @classmethod
        def probe(cls):
            return answer

    registry.register_backend("odd", Odd)
    assert "probe() returned" in registry.availability()["odd"]


@pytest.mark.parametrize("raised", [GeneratorExit, SystemExit])
def test_a_probe_raising_a_base_exception_is_a_reason_not_the_registrys_end(raised):
    class Raises(FakeBackend):
        name = "raises"

        @classmethod
        def probe(cls):
            raise raised()

    registry.register_backend("raises", Raises)
    assert "probe raised" in registry.availability()["raises"]
    assert registry.select_backend_name() != "raises"


def test_the_environment_names_a_backend_with_the_spaces_a_config_file_leaves(monkeypatch):
    monkeypatch.setenv(registry.ENV_BACKEND, " cpu\n")
    assert registry.select_backend_name() == "cpu"


def test_a_workers_device_type_comes_after_name_and_environment(monkeypatch):
    """The one selection path: explicit name, environment, the KV tensors' device type, then priority."""
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    assert registry.select_backend_name(device_type="cpu") == "cpu"
    assert registry.select_backend_name("cpu", device_type="cuda") == "cpu"
    monkeypatch.setenv(registry.ENV_BACKEND, "cpu")
    assert registry.select_backend_name(device_type="cuda") == "cpu"
    monkeypatch.delenv(registry.ENV_BACKEND)
    with pytest.raises(UnknownBackendError):
        registry.select_backend_name(device_type="tpu")


class BadPriority(FakeBackend):
    name = "odd"
    priority = "high"


@pytest.mark.parametrize(
    "attr, body, reason",
    [
        ("NotABackend", "NotABackend = len", "not a Backend subclass"),
        ("BadPriority", None, "has priority 'high', not an int"),
        ("Leaving", "import sys; sys.exit(3)", "cannot import"),
    ],
)
def test_a_plugin_that_is_not_a_backend_is_unavailable_not_fatal(monkeypatch, tmp_path, attr, body, reason):
    """A plugin whose target is no Backend subclass, ranks with a priority that is no int, or ends
    the process while importing: unavailable, with the reason; the others, and the selection, work."""
    if body is None:
        module = types.ModuleType("odd_plugin")
        module.BadPriority = BadPriority
        monkeypatch.setitem(sys.modules, "odd_plugin", module)
    else:
        (tmp_path / "odd_plugin.py").write_text(body + "\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "odd_plugin", raising=False)
    eps = [EntryPoint("odd", f"odd_plugin:{attr}", registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    with fresh_registry():
        assert reason in registry.availability()["odd"]
        assert registry.get_backend().name in {"cpu", "cuda", "npu", "xpu"}
        with pytest.raises(BackendUnavailableError, match=reason):
            registry.get_backend("odd")


@pytest.mark.parametrize("setting", ["false", "off", " 2", "garbage"])
def test_the_plugins_switch_takes_0_or_1(monkeypatch, setting):
    from offload_core import ConfigError

    monkeypatch.setenv(registry.ENV_PLUGINS, setting)
    with fresh_registry():
        with pytest.raises(ConfigError, match=f"OFFLOAD_CORE_PLUGINS must be 0 .* or 1, got {setting.strip()!r}"):
            registry.backend_names()
    monkeypatch.setenv(registry.ENV_PLUGINS, " 0 ")
    with fresh_registry():
        assert "cpu" in registry.backend_names()
    monkeypatch.setenv(registry.ENV_PLUGINS, " ")  # empty, as unset: as every variable of offload-core
    with fresh_registry():
        assert "cpu" in registry.backend_names()


def test_an_empty_backend_name_is_refused(monkeypatch):
    monkeypatch.setenv(registry.ENV_BACKEND, "cpu")
    with pytest.raises(UnknownBackendError, match="unknown offload backend ''"):
        registry.get_backend("")


def _imports() -> dict[str, set[str]]:
    """Each module of offload_core/ and backends/ (as installed: offload_core.backends) and the
    modules of both that importing it runs: every import statement (in functions too), relative
    ones resolved, with the packages above an imported module that do not hold the importer;
    the body of ``if TYPE_CHECKING:`` aside."""
    import ast
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    files, packages = {}, set()
    for path in [*root.joinpath("offload_core").rglob("*.py"), *root.joinpath("backends").rglob("*.py")]:
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[0] == "backends":
            parts.insert(0, "offload_core")
        if parts[-1] == "__init__":
            parts.pop()
            packages.add(".".join(parts))
        files[".".join(parts)] = path
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        here = name if name in packages else name.rpartition(".")[0]  # what a relative import starts from
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for statement in node.body
            for n in ast.walk(statement)
        }
        found = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                module = importlib.util.resolve_name("." * node.level + (node.module or ""), here)
                named = (f"{module}.{a.name}" for a in node.names)
                found |= {m if m in files else module for m in named}  # a submodule, or a name of one
        for module in list(found):
            parts = module.split(".")
            found |= {p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if not name.startswith(p + ".")}
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def test_the_modules_import_each_other_without_a_circle():
    """Every import of one module by another points one way: no module is reached again from
    the modules it imports, and the core imports no backend (docs/architecture.md §11)."""
    graph = _imports()
    core = [n for n in graph if not n.startswith(("offload_core.backends", "offload_core.testing"))]
    backends = {n: sorted(d for d in graph[n] if d.startswith("offload_core.backends")) for n in core}
    assert not {n: found for n, found in backends.items() if found}, "the core imports a backend"
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                raise AssertionError("an import circle: " + " -> ".join([*path[path.index(dep) :], dep]))
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
