"""``kiln keygen`` and the servers' refusal to start without the keys they need: quick, in-process, real files."""

import stat

import pytest

from kiln.rpc.auth import TokenFileError, TokenTable
from kiln.store.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, Signer, TrustedKeys
from kiln_cli import main


def test_keygen_writes_a_key_pair_certificates_and_tokens_and_keeps_them(tmp_path, capsys):
    keys, signing = tmp_path / "keys", tmp_path / "signing"
    argv = ["keygen", str(keys), "--signing-dir", str(signing), "--tls-hosts", "compile,127.0.0.1", "--tokens"]
    assert main(argv) == 0
    private = signing / PRIVATE_KEY_FILE
    assert not (keys / PRIVATE_KEY_FILE).exists(), "the private key goes to --signing-dir only"
    for secret in (private, keys / "server.key", keys / "client.key", keys / "tokens", keys / "admin.token"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    signer = Signer.load(private)
    assert signer.key_id in TrustedKeys.load(keys / PUBLIC_KEY_FILE).keys
    table = TokenTable.load(keys / "tokens")
    assert table.role_of((keys / "admin.token").read_text().strip()) == "admin"
    assert table.role_of((keys / "user.token").read_text().strip()) == "user"
    assert table.role_of("x" * 43) is None
    before = {p.name: p.read_bytes() for p in [*keys.iterdir(), private]}
    assert main(argv) == 0  # a second run (compose restarts the one-shot service) changes nothing
    assert {p.name: p.read_bytes() for p in [*keys.iterdir(), private]} == before
    assert "signing key" in capsys.readouterr().out


@pytest.mark.parametrize("command, missing", [
    (["compile-server", "--store", "STORE"], "--signing-key"),
    (["exec-server"], "--trusted-keys"),
    (["exec-server", "--trusted-keys", "NOWHERE"], "NOWHERE"),
    (["compile-server", "--store", "STORE", "--signing-key", "NOWHERE"], "NOWHERE"),
])
def test_servers_refuse_to_start_without_their_keys(tmp_path, monkeypatch, capsys, command, missing):
    for variable in ("KILN_SIGNING_KEY", "KILN_TRUSTED_KEYS"):
        monkeypatch.delenv(variable, raising=False)
    argv = [a.replace("STORE", str(tmp_path / "store")).replace("NOWHERE", str(tmp_path / "nowhere"))
            for a in command]
    assert main(argv) == 2
    assert missing.replace("NOWHERE", str(tmp_path / "nowhere")) in capsys.readouterr().err


def test_a_malformed_token_file_names_the_line_not_the_token(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# comment\nadmin a-long-enough-admin-token\nroot short\n")
    with pytest.raises(TokenFileError) as exc:
        TokenTable.load(path)
    assert "line 3" in str(exc.value) and "short" not in str(exc.value)
