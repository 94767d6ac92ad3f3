"""scripts/config_doc.py: docs/configuration.md holds the tables the tpserve parser renders now;
an option the page lacks makes --check fail and names it; a rewrite makes the page current again
and keeps its hand-written intro. No Ray: the parsers import none."""

from __future__ import annotations

from scripts import config_doc


def test_the_committed_page_is_what_the_parser_renders():
    diff = config_doc.stale_lines(config_doc.DOC.read_text(), config_doc.generated_block())
    assert diff == [], "\n".join(diff)
    assert config_doc.main(["--check"]) == 0


def test_every_serve_and_generate_option_has_a_row():
    block = config_doc.generated_block()
    commands = config_doc.subcommand_parsers(config_doc.tpserve_parser())
    for name in config_doc.COMMANDS:
        for action in commands[name]._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in block, f"tpserve {name} {flag}"


def _parser_with_an_extra_serve_option():
    parser = config_doc.tpserve_parser()
    serve = config_doc.subcommand_parsers(parser)["serve"]
    serve.add_argument("--extra-knob", type=int, default=7, choices=(7, 8), help="a new knob")
    return parser


def test_a_new_option_makes_the_check_fail_naming_it(capsys):
    parser = _parser_with_an_extra_serve_option()
    diff = config_doc.stale_lines(config_doc.DOC.read_text(), config_doc.generated_block(parser))
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert added == ["+| `--extra-knob` int | `7` | `7`, `8` | a new knob |"]

    assert config_doc.main(["--check"], parser=parser) == 1
    assert "--extra-knob" in capsys.readouterr().err


def test_a_rewrite_brings_a_stale_page_up_to_date_and_keeps_the_intro(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    page.write_text("# intro by hand\n\n" + config_doc.generated_block() + "\nafter\n")
    parser = _parser_with_an_extra_serve_option()
    assert config_doc.main(["--check", "--doc", str(page)], parser=parser) == 1

    assert config_doc.main(["--doc", str(page)], parser=parser) == 0
    assert config_doc.main(["--check", "--doc", str(page)], parser=parser) == 0
    text = page.read_text()
    assert text.startswith("# intro by hand\n") and text.endswith("\nafter\n")
    assert "`--extra-knob`" in text


def test_a_page_without_the_markers_is_refused_by_name(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    page.write_text("# no markers\n")
    assert config_doc.main(["--check", "--doc", str(page)]) == 2
    assert "BEGIN GENERATED" in capsys.readouterr().err


def test_an_api_key_in_the_environment_never_reaches_the_page(monkeypatch):
    monkeypatch.setenv("TPSERVE_API_KEY", "secret-key-123")
    assert "secret-key-123" not in config_doc.generated_block()
