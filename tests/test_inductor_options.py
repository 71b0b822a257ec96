"""The Inductor option allowlist: the installed torch's whole config walked against it, and every refused class of
option sent through the real compile server while the test watches that no process starts and no file is written
outside the store."""

import json
import os
import subprocess
import sys
import types
import typing

import grpc
import pytest
from conftest import TINY_CONFIG, TINY_MODEL, compile_result
from torch._inductor import config as inductor_config

from kiln.compilation import inductor_options
from kiln.compilation.config import CompileConfig
from protos import common_pb2

_SIMPLE = (bool, int, float, type(None))


def _only_numbers(value_type) -> bool:
    """True when every value the type admits is a bool, a number, None, or a container of those."""
    if value_type in _SIMPLE:
        return value_type is not type(None)
    origin = typing.get_origin(value_type)
    args = [a for a in typing.get_args(value_type) if a is not Ellipsis]
    if origin is typing.Literal:
        return all(isinstance(a, (bool, int, float)) for a in args)
    if origin in (list, tuple, dict, set, frozenset, typing.Union, types.UnionType):
        return bool(args) and all(a is type(None) or _only_numbers(a) for a in args) and any(
            a is not type(None) for a in args)
    return False


def takes_string_or_callable(entry) -> bool:
    """An option whose declared type admits a string, a callable, a class, Any, or is not declared at all."""
    return not _only_numbers(entry.value_type)


def test_every_option_that_takes_a_string_or_a_callable_is_allowed_or_refused_on_purpose():
    unclassified = sorted(
        name for name, entry in inductor_config._config.items()
        if takes_string_or_callable(entry) and name not in inductor_options.ALLOWED
        and inductor_options.refusal_reason(name) is None)
    assert not unclassified, (f"new Inductor options that take a string or a callable: add each to ALLOWED or "
                              f"REFUSED in kiln/compilation/inductor_options.py, with a reason: {unclassified}")


def test_the_walk_sees_what_it_must():
    """The classifier is not vacuous: the options that once let a client run a program are among those it flags."""
    flagged = {name for name, entry in inductor_config._config.items() if takes_string_or_callable(entry)}
    assert {"cpp.cxx", "trace.debug_dir", "post_grad_custom_post_pass", "inductor_choices_class",
            "global_cache_dir"} <= flagged
    assert "max_autotune" not in flagged and "compile_threads" not in flagged


def test_every_allowed_option_exists_and_accepts_its_own_default():
    for name, allowed in inductor_options.ALLOWED.items():
        assert name in inductor_config._config, f"{name} is allowed but this torch has no such option"
        assert inductor_options.refusal_reason(name) is None, f"{name} is both allowed and refused"
        default = inductor_config._config[name].default
        assert allowed.check(default), f"{name}: its default {default!r} is not {allowed.says}"


def test_allowed_options_with_good_values_pass_and_bad_values_name_the_option():
    config = CompileConfig.from_proto(common_pb2.CompileConfig(device="cpu", inductor_config_patches_json=json.dumps(
        {"max_autotune": False, "triton.max_tiles": 2, "max_autotune_gemm_backends": "ATEN,TRITON",
         "cpp.simdlen": None})))
    assert config.inductor_config_patches["triton.max_tiles"] == 2
    for patch, says in [({"max_autotune": "yes"}, "true or false"), ({"max_fusion_size": 10**9}, "[1, 1024]"),
                        ({"max_autotune_gemm_backends": "ATEN,CUTLASS"}, "comma-separated"),
                        ({"triton.max_tiles": True}, "integer")]:
        with pytest.raises(inductor_options.InvalidArgument) as exc:
            CompileConfig.from_proto(common_pb2.CompileConfig(inductor_config_patches_json=json.dumps(patch)))
        assert next(iter(patch)) in str(exc.value) and says in str(exc.value)


# --- through the real compile server, watched ----------------------------------------------------------------

_WATCHERS: list[list] = []
_PROCESS_EVENTS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "pty.spawn"}
_WRITE_EVENTS = {"os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.symlink", "os.link",
                 "os.truncate", "shutil.copyfile", "shutil.rmtree"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _audit(event: str, args: tuple) -> None:
    if not _WATCHERS:
        return
    if event in _PROCESS_EVENTS:
        record = (event, str(args[0]) if args else "")
    elif event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        mode, flags = args[1], args[2] if len(args) > 2 else 0
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
        if not writes:
            return
        record = ("open", os.fsdecode(args[0]))
    elif event in _WRITE_EVENTS and args:
        record = (event, os.fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else str(args[0]))
    else:
        return
    for watcher in _WATCHERS:
        watcher.append(record)


sys.addaudithook(_audit)  # hooks cannot be removed; this one does nothing while no test watches


class Watch:
    """Every process started and every file written in this process (all threads) while it is active."""

    def __enter__(self):
        self.events: list = []
        _WATCHERS.append(self.events)
        return self

    def __exit__(self, *exc):
        _WATCHERS.remove(self.events)

    def outside(self, root) -> list:
        root = os.fspath(root)
        return [(event, path) for event, path in self.events
                if event != "open" or not (path.startswith(root + os.sep) or "__pycache__" in path)]


def test_the_watch_sees_processes_and_writes(tmp_path):
    with Watch() as watch:
        subprocess.run(["true"], check=True)
        (tmp_path / "written").write_text("x")
    assert any(event == "subprocess.Popen" for event, _ in watch.events)
    assert ("open", str(tmp_path / "written")) in watch.outside("/nonexistent")


def refused_patches(tmp_path) -> list[tuple[str, dict]]:
    """One option of every refused class, each aimed at something the test can see happen."""
    script = tmp_path / "evil-cxx"
    script.write_text(f"#!/bin/sh\ntouch {tmp_path / 'cxx-ran'}\nexec g++ \"$@\"\n")
    script.chmod(0o755)
    outside = tmp_path / "outside"
    return [
        ("binary", {"cpp.cxx": [None, str(script)]}),
        ("binary", {"cuda.cuda_cxx": str(script)}),
        ("path", {"global_cache_dir": str(outside)}),
        ("debug", {"trace.debug_dir": str(outside), "trace.enabled": True}),
        ("code", {"post_grad_custom_post_pass": "os.system"}),
        ("code", {"inductor_choices_class": "builtins.exec"}),
        ("workers", {"compile_threads": 64}),
        ("workers", {"worker_start_method": "fork"}),
        ("testing", {"cpp.inject_relu_bug_TESTING_ONLY": "compile_error"}),
        ("backend", {"cpu_backend": "halide"}),
        ("operator", {"freezing": True}),
        ("internal", {"_profile_var": "x"}),
        ("not allowlisted", {"cpp_wrapper": True}),
    ]


def test_every_refused_option_class_is_refused_through_the_server_and_nothing_runs(compile_stub, compile_store,
                                                                                  tiny_key, tmp_path):
    cases = refused_patches(tmp_path)
    with Watch() as watch:
        for kind, patch in cases:
            config = common_pb2.CompileConfig()
            config.CopyFrom(TINY_CONFIG)
            config.inductor_config_patches_json = json.dumps(patch)
            with pytest.raises(grpc.RpcError) as exc:
                compile_result(compile_stub, TINY_MODEL, config)
            refused = next(iter(patch))  # the first refused option is the one named
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED, (kind, exc.value.details())
            details = exc.value.details()
            assert "config.inductor_config_patches_json" in details and refused in details, (kind, details)
        for patch, code in [({"no_such_option": 1}, grpc.StatusCode.INVALID_ARGUMENT),
                            ({"max_autotune": "yes"}, grpc.StatusCode.INVALID_ARGUMENT)]:
            config = common_pb2.CompileConfig(inductor_config_patches_json=json.dumps(patch), device="cpu")
            with pytest.raises(grpc.RpcError) as exc:
                compile_result(compile_stub, TINY_MODEL, config)
            assert exc.value.code() == code and next(iter(patch)) in exc.value.details()
    assert not [e for e in watch.events if e[0] != "open" and not e[0].startswith(("os.", "shutil."))], watch.events
    assert not watch.outside(compile_store), watch.outside(compile_store)
    assert not (tmp_path / "cxx-ran").exists() and not (tmp_path / "outside").exists()
    assert compile_result(compile_stub).cache_hit  # and the server still serves


def test_the_execute_service_refuses_them_too(exec_stub):
    from protos import exec_pb2

    config = common_pb2.CompileConfig()
    config.CopyFrom(TINY_CONFIG)
    config.inductor_config_patches_json = json.dumps({"cpp.cxx": [None, "/bin/sh"]})
    with pytest.raises(grpc.RpcError) as exc:
        list(exec_stub.LoadModel(exec_pb2.LoadModelRequest(name="evil", model=TINY_MODEL, config=config)))
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED and "cpp.cxx" in exc.value.details()
