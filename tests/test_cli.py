"""The kvserve CLI on the tiny model: generate, chat, flags generated from EngineConfig."""

from __future__ import annotations

import io

from kvserve.cli import main


def test_generate_prints_text(tiny_model_dir, capsys):
    code = main(["generate", "Hello", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--max-tokens", "4", "--num-kv-blocks", "64", "--no-enable-prefix-caching"])
    assert code == 0
    assert capsys.readouterr().out.strip() != ""


def test_chat_streams_replies_until_eof(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi there\n\nand again\n"))
    code = main(["chat", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--max-tokens", "3", "--num-kv-blocks", "64", "--system", "be brief"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("kvserve chat")


def test_unknown_model_exits_2_with_a_message(capsys):
    assert main(["generate", "x", "--model", "no-such-model"]) == 2
    assert "Cannot find model" in capsys.readouterr().err
