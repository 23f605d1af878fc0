"""The ``attn_backends.commands`` entry-point group: subcommands registered by other packages
(runtime's ``generate``) without attn_backends importing them."""
import types

from attn_backends.check import cli


def fake_ep(name, load):
    return types.SimpleNamespace(name=name, value=f"fake:{name}", load=load)


def test_installed_generate_command_is_found():
    assert "generate" in [ep.name for ep in cli._extra_commands()]
    assert "generate" in cli.build_parser()._subparsers._group_actions[0].choices


def test_a_registered_command_runs_its_handler(monkeypatch):
    calls = []

    def register(sub):
        p = sub.add_parser("hello")
        p.add_argument("--n", type=int, default=1)
        p.set_defaults(handler=lambda args: calls.append(args.n) or 7)

    monkeypatch.setattr(cli, "_extra_commands", lambda: [fake_ep("hello", lambda: register)])
    assert cli.main(["hello", "--n", "3"]) == 7 and calls == [3]


def test_a_broken_command_warns_and_the_rest_works(monkeypatch, capsys):
    def boom():
        raise ImportError("no module named nowhere")

    monkeypatch.setattr(cli, "_extra_commands", lambda: [fake_ep("broken", boom)])
    assert cli.main(["list", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "command 'broken' (fake:broken) failed to load: no module named nowhere" in err


def test_a_command_cannot_shadow_check(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_extra_commands", lambda: [fake_ep("check", lambda: lambda sub: None)])
    assert cli.main(["list"]) == 2
    assert "redefines the command 'check'" in capsys.readouterr().err


def test_main_without_a_command_is_a_usage_error(capsys):
    assert cli.main([]) == 2
    assert "attn-backends: error: the following arguments are required: command" in capsys.readouterr().err
