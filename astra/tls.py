"""Transport security of a run: which PEM files this process uses, read and checked once.

Every Astra process, server and client alike, uses mutual TLS when its environment names the
run's credentials, and plaintext otherwise:

- ``ASTRA_TLS_DIR``: a directory holding ``ca.pem`` (the run's certificate authority),
  ``cert.pem`` and ``key.pem`` (this node's certificate and private key), as
  ``astra tls init`` and ``astra tls issue`` write it; or
- ``ASTRA_TLS_CA``, ``ASTRA_TLS_CERT`` and ``ASTRA_TLS_KEY``: the three files by path, all three.

Servers then accept only clients whose certificate the CA signed, and clients accept only
servers whose certificate the CA signed for the host they dial (an IP address or DNS name in
its subjectAltName). ``ASTRA_TLS_SERVER_NAME`` makes clients check that name instead of the
dialled host (a certificate issued for a DNS name, dialled by IP). The same files serve both
ends, so one credential per node is enough. Never touches gRPC.

A certificate revocation list signed by the CA (astra.tls_crl), ``crl.pem`` in ASTRA_TLS_DIR
where there is one or the file ``ASTRA_TLS_CRL`` names, lists the certificates servers refuse
(`TlsMaterial.revoked`, enforced per call by servers.authz).

The files are read again when they change (`TlsFiles.refresh`, at most once a second): a
server's next handshake shows the new certificate and checks clients against the new CA file,
and channels opened after it use the new files. Files that changed into something unusable (a
key written before its certificate, a certificate the CA did not sign) leave the credentials in
use as they are until they are whole again.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from astra.tls_crl import CrlError, carried, kept, own_revoked, with_list
from astra.tls_material import (
    ENV_CRL,
    ENV_DIR,
    ENV_FILES,
    ENV_SERVER_NAME,
    EXPIRY_WARN_S,
    RECHECK_S,
    TlsConfigError,
    TlsMaterial,
    _check,
    _read_pem,
    crl_path,
    expires_in_s,
    tls_paths,
)

log = logging.getLogger(__name__)


def load_tls(env: Mapping[str, str] | None = None, *, with_crl: bool = True) -> TlsMaterial | None:
    """This process's TLS material, None when its environment asks for plaintext. A
    revocation list that cannot be used raises astra.tls_crl.CrlError (a TlsConfigError);
    `with_crl` False leaves it out."""
    env = os.environ if env is None else env
    paths = tls_paths(env)
    if paths is None:
        return None
    via = {k: ENV_DIR if env.get(ENV_DIR) else ENV_FILES[k] for k in paths}
    pem = {k: _read_pem(k, p, via[k]) for k, p in paths.items()}
    _check(pem, paths)
    source = env.get(ENV_DIR) or ", ".join(str(p) for p in paths.values())
    material = TlsMaterial(**pem, server_name=env.get(ENV_SERVER_NAME, ""), source=source)
    if not with_crl:
        return material

    return with_list(material, env)


def _stamp(paths: Iterable[Path]) -> tuple[tuple[int, int, int] | None, ...]:
    """What tells a file changed: inode (a file renamed over it), size and mtime."""
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class TlsFiles:
    """The TLS setting of an environment and its material, read again when the files change.
    The first read raises TlsConfigError (a wrong setting stops the process); later ones keep
    the material in use and log why (see the module docstring). Thread-safe: gRPC asks a
    server's credentials from its own threads."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        self.paths = tls_paths(self.env)
        crl = crl_path(self.env)[0] if self.paths else None
        self.watched = [*(self.paths or {}).values(), *([crl] if crl else [])]
        self.stamp = _stamp(self.watched)

        self.material = load_tls(self.env)
        if self.material is not None and own_revoked(self.material):
            raise TlsConfigError(
                f"the certificate of {self.material.source} is revoked by {self.material.crl}: "
                "issue this node a new one (astra tls issue)"
            )
        if self.material is not None and self.material.crl_note:
            log.warning("%s", self.material.crl_note)
        self.reloads = 0
        self._checked = time.monotonic()
        self._refused: tuple = ()
        self._lock = threading.Lock()
        self._expiry_checked = -float("inf")
        self._warn_expiry(self._checked)

    def _warn_expiry(self, now: float) -> None:
        """Looked at once a day at most: a warning while the certificate in use ends within
        EXPIRY_WARN_S."""
        if self.material is None or now - self._expiry_checked < 86400.0:
            return
        self._expiry_checked = now
        with contextlib.suppress(Exception):  # a warning only: never in the way of a handshake
            left = expires_in_s(self.material.cert)
            if left < EXPIRY_WARN_S:
                log.warning("the TLS certificate of %s expires in %.1f days: renew it in place "
                            "(astra tls issue), no restart needed", self.material.source,
                            left / 86400)  # fmt: skip
            due = self.material.crl_next_update
            if due and due < time.time():
                log.warning("the revocation list %s is past its nextUpdate (%s UTC); what it "
                            "revokes still holds: renew it (astra tls revoke CA_DIR) and copy "
                            "it to the nodes", self.material.crl,
                            datetime.datetime.fromtimestamp(due, datetime.UTC)
                            .strftime("%Y-%m-%d %H:%M"))  # fmt: skip

    def refresh(self) -> TlsMaterial | None:
        """The material to use now: read again if the files changed (looked at once a
        RECHECK_S at most)."""
        if self.paths is None:
            return None
        with self._lock:
            now = time.monotonic()
            if now - self._checked < RECHECK_S:
                return self.material
            self._checked = now
            self._warn_expiry(now)
            stamp = _stamp(self.watched)
            if stamp == self.stamp:
                return self.material

            try:
                try:
                    material = carried(load_tls(self.env), self.material)
                except CrlError as exc:  # the rest may be fine: used, with the list in use
                    why = f"{exc}; the revocations in use stay"
                    material = load_tls(self.env, with_crl=False)
                    if self.material is not None:
                        material = kept(material, self.material, why)
            except TlsConfigError as exc:
                if stamp != self._refused:  # once per state of the files
                    self._refused = stamp
                    log.warning("TLS files changed but cannot be used yet: %s; "
                                "the credentials in use stay", exc)  # fmt: skip
                return self.material
            if material is not None and material.crl_note:
                log.warning("%s", material.crl_note)
            self.stamp, self.material = stamp, material
            self.reloads += 1
            log.info("TLS credentials read again from %s (%d revoked)", material.source,
                     len(material.revoked))  # fmt: skip
            if own_revoked(material):  # its callers refuse it; its own checks still hold
                log.error("the certificate of %s is revoked by %s: issue this node a new one "
                          "(astra tls issue)", material.source, material.crl)  # fmt: skip
            self._expiry_checked = -float("inf")  # the new certificate's own end
            self._warn_expiry(now)
            return material


_cache: dict[tuple[str, ...], TlsFiles] = {}


def tls_files() -> TlsFiles | None:
    """The TlsFiles of this process's environment (one per distinct setting), None for
    plaintext."""
    names = (ENV_DIR, *ENV_FILES.values(), ENV_SERVER_NAME, ENV_CRL)
    key = tuple(os.environ.get(n, "") for n in names)
    if key not in _cache:
        _cache[key] = TlsFiles()
    files = _cache[key]
    return None if files.paths is None else files


def current_tls() -> TlsMaterial | None:
    """This process's TLS material now (`load_tls`, read again when its files change)."""
    files = tls_files()
    return None if files is None else files.refresh()
