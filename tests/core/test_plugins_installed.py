"""Plugins installed on the machine never break our tests: with a greedy, buggy plugin and one
that cannot import in the entry-point group, our registry, CLI and selection tests still pass and
the suite tests still run on our built-ins only."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = textwrap.dedent('''
    from dataclasses import replace
    from attn_backends import ForwardMode
    from attn_backends.backends.torch_native import TorchNativeBackend

    class Greedy(TorchNativeBackend):
        """Claims every mode, IDLE included, with a high preference; its replay drops the + W."""
        name = "greedy_buggy"
        capabilities = replace(TorchNativeBackend.capabilities, modes=frozenset(ForwardMode), preference=100)

        def _prepare_graph(self, inputs, capture):
            super()._prepare_graph(inputs, capture)
            if not capture:
                lay = self.forward_metadata.layout
                lay.seq_lens_k.sub_(lay.width)
''')
PROBE = textwrap.dedent('''
    from attn_backends import ForwardMode, ModelConfig, list_backends, select
    names = {i.name: i.available for i in list_backends("cpu")}
    cfg = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16)
    print(names["greedy_buggy"], names["broken_plugin"], select(cfg, mode=ForwardMode.IDLE, device="cpu").name)
''')


def test_our_tests_pass_with_plugins_installed(tmp_path):
    (tmp_path / "greedy_plugin_mod.py").write_text(PLUGIN)
    info = tmp_path / "greedy_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: greedy-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[attn_backends.backends]\ngreedy_buggy = greedy_plugin_mod:Greedy\n"
                                           "broken_plugin = no_such_module_xyz:Nothing\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True)
    assert probe.stdout.split() == ["True", "False", "greedy_buggy"], probe.stderr   # installed, and it wins

    run = lambda *args: subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],  # noqa: E731
                                       cwd=ROOT, env=env, capture_output=True, text=True)
    collected = run("--collect-only", "tests/check/test_layout_suite.py", "tests/backends/test_triton_backends.py")
    assert collected.returncode == 0 and "greedy_buggy" not in collected.stdout, collected.stdout[-2000:]
    res = run("tests/core/test_registry.py", "tests/check/test_cli.py",
              "tests/check/test_layout_suite.py::test_worked_example",
              "tests/core/test_bad_config.py::test_select_refuses_a_mode_with_the_reason",
              "-k", "not for_real and not subprocess")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
