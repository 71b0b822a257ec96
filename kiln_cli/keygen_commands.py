"""``kiln keygen DIR``: the bundle-signing key pair, and on request TLS certificates and tokens (compose's one-shot
key service runs it). Existing files are kept, so a second run changes nothing."""

from pathlib import Path

from kiln.rpc import keygen
from kiln.store.signing import generate_key_pair


def register(subparsers) -> None:
    p = subparsers.add_parser("keygen", help="write a bundle-signing key pair (and TLS certificates, tokens)")
    p.add_argument("dir", help="where signing.pub (and signing.key, the certificates, the tokens) are written")
    p.add_argument("--signing-dir", default=None,
                   help="write the private signing.key here instead, apart from what the execute service reads")
    p.add_argument("--tls-hosts", default="",
                   help="comma-separated names and IPs: also write ca.pem, server.pem/.key valid for them, and "
                        "client.pem/.key for mutual TLS")
    p.add_argument("--tokens", action="store_true",
                   help="also write 'tokens' (the servers' --auth-token-file) and admin.token, user.token")
    p.set_defaults(handler=run_keygen)


def run_keygen(args) -> int:
    directory = Path(args.dir)
    private, public = generate_key_pair(args.signing_dir or directory, directory)
    print(f"signing key {private}\npublic key  {public} (the execute service's --trusted-keys)")
    hosts = [h.strip() for h in args.tls_hosts.split(",") if h.strip()]
    if hosts:
        tls = keygen.tls_material(directory, hosts)
        print(f"TLS CA      {tls.ca}\nserver      {tls.server_cert}, {tls.server_key} ({', '.join(hosts)})\n"
              f"client      {tls.client_cert}, {tls.client_key}")
    if args.tokens:
        table, admin, user = keygen.token_files(directory)
        print(f"tokens      {table} (--auth-token-file); {admin}, {user} (KILN_CLIENT_TOKEN_FILE)")
    return 0
