"""The cluster secret: the shared key every process of one deployment seals frames with
(`actors.frame_auth.FrameAuth`).

Where it comes from (`load_cluster_secret`): the file named on the command line (its
bytes, less one trailing newline; readable by its owner only), else the environment
variable `PAGEDSERVE_CLUSTER_SECRET`, else nowhere (None: frames are not authenticated,
which is fine for ipc on one host and for nothing that crosses a network). A file is
better than the environment: other users cannot read it, and it stays out of process
listings and crash reports.

Make one on the first host, copy it to the others over a channel you trust (scp):

    python -m actors.cluster_secret /etc/pagedserve/cluster.secret   # written mode 600
    python -m actors.cluster_secret                                 # or print one

The secret is never logged and never part of a repr; errors name the file or the
variable, not its value.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys

from actors.frame_auth import check_secret

ENV_VAR = "PAGEDSERVE_CLUSTER_SECRET"
SECRET_HEX_BYTES = 32  # 256 bits of randomness, written as 64 hex characters


def new_cluster_secret() -> str:
    """A fresh random secret as text (64 hex characters)."""
    return secrets.token_hex(SECRET_HEX_BYTES)


def load_cluster_secret(secret_file: str | None) -> bytes | None:
    """The secret from `secret_file`, else from $PAGEDSERVE_CLUSTER_SECRET, else None.

    Raises ValueError for a file that cannot be read or that group or others may access
    (the message says `chmod 600 FILE`), and for a secret shorter than 16 bytes (an
    empty variable included: unset it to run without one)."""
    if secret_file is not None:
        secret = _read_secret_file(secret_file)
        check_secret(secret, f"the cluster secret in {secret_file}")
        return secret
    value = os.environ.get(ENV_VAR)
    if value is None:
        return None
    secret = value.encode()
    check_secret(secret, f"the cluster secret in ${ENV_VAR}")
    return secret


def secret_environment(secret: bytes) -> dict[str, str]:
    """A child process's environment entry that hands it `secret` (read back by
    `load_cluster_secret(None)`)."""
    return {ENV_VAR: secret.decode()}


def _read_secret_file(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ValueError(
                    f"the cluster secret file {path} is open to group or others (mode "
                    f"{stat.S_IMODE(mode):03o}); make it private with `chmod 600 {path}`"
                )
            data = file.read()
    except OSError as exc:
        raise ValueError(f"cannot read the cluster secret file {path}: {exc.strerror}") from None
    return data.removesuffix(b"\n").removesuffix(b"\r")


def write_cluster_secret(path: str) -> None:
    """Writes a new secret to `path`, created readable by its owner only (mode 600);
    refuses to replace an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(new_cluster_secret() + "\n")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print("usage: python -m actors.cluster_secret [FILE]", file=sys.stderr)
        return 2
    if not argv:
        print(new_cluster_secret())
        return 0
    try:
        write_cluster_secret(argv[0])
    except OSError as exc:
        print(f"cannot write {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
