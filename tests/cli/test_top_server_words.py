"""`tierkv top --endpoint`: what a server says (a reason phrase, a bad status line) and what a snapshot holds
reaches the terminal with its escape sequences, bidi controls and line separators shown as '?'."""
from __future__ import annotations

import socket
import threading

import pytest

from tierkv.cli import main

# what a hostile server sends: a window title, a screen clear and a colour in the reason phrase, or before the
# status line
REPLIES = {
    "reason": b"HTTP/1.1 500 \x1b]0;PWNED\x07\x1b[2J\x1b[31mred \xe2\x80\xae\r\nContent-Length: 2\r\n\r\n{}",
    "status_line": b"\x1b]0;PWNED\x07\x1b[2JHTTP/9 x\r\n\r\n",
}


@pytest.fixture
def server_saying():
    """A server answering every connection with one raw reply; yields a function: reply name -> URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    reply = {}

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed at the end of the test
                return
            with conn:
                conn.settimeout(5)
                try:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    conn.sendall(reply["bytes"])
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def url_for(name: str) -> str:
        reply["bytes"] = REPLIES[name]
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield url_for
    listener.close()
    thread.join(5)


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_a_servers_words_never_reach_the_terminal_as_escapes(server_saying, capsys, name):
    assert main(["top", "--endpoint", server_saying(name), "--once"]) == 1
    err = capsys.readouterr().err
    assert "tierkv top: error:" in err and "?]0;PWNED??[2J" in err
    assert not any(c in err for c in "\x1b\x07\r\u202e")
    assert err.count("\n") == 1  # one line: the server's CR LF is not passed on either


def test_bidi_controls_separators_and_lone_surrogates_in_a_snapshot_are_shown_as_question_marks():
    """U+202E reverses what follows on the terminal, U+2028 breaks a line, a lone surrogate made print() raise."""
    from tierkv.cli.top import render

    line = {"run_id": "r\u202eevil\u2066", "seq": 1, "kind": "k\ud800", "elapsed_s": 1.0,
            "figures": {"tier.cpu.hits": 1, "tier.d\u2028isk\u200f.hits": 2}, "rates": {}}
    frame = render(line, "src", width=200)
    assert not any(c in frame for c in "\u202e\u2066\ud800\u2028\u200f")
    assert "r?evil?" in frame and "d?isk?" in frame and "k?" in frame
    frame.encode("utf-8")  # nothing print() could not write


def test_shown_keeps_printable_text_and_only_the_characters_asked():
    from tierkv.metrics.sources import shown

    assert shown("tier disk: 5 µs, 中文 ok") == "tier disk: 5 µs, 中文 ok"
    assert shown("a\nb\tc\x9b\u202ed", keep="\n") == "a\nb?c??d"
    assert shown("a\nb") == "a?b"
