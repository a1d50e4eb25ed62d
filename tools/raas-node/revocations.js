'use strict';
// The revocation list a node holds (docs/deployment.md, "Mutual TLS"), read with crl.js: ASTRA_TLS_CRL if
// set (it must exist), else crl.pem in the TLS directory when there is one. Read at start (a
// list that cannot be used stops the node, as does its own certificate listed), then again
// when its file changes (stat, once a second). A running node fails closed: when the list
// disappears, cannot be used, is an older one of the same CA (a lower CRLNumber) or is another
// CA's, the revocations it holds stay, and the log says why. A list past its nextUpdate still
// revokes, with a warning (daily). The rules are astra/tls_crl.py's `carried`.

const crypto = require('crypto');
const fs = require('fs');
const path = require('path');
const { readList, serialHex } = require('./crl');

const CRL_FILE = 'crl.pem';
const LOOK_MS = 1000;
const WARN_MS = 86400 * 1000;

class Revocations {
  // `dir`: the TLS directory; `env`: where ASTRA_TLS_CRL is read; `ca`, `cert`: PEM buffers.
  constructor(dir, ca, cert, log, env = process.env) {
    this.required = Boolean(env.ASTRA_TLS_CRL);
    this.file = this.required ? env.ASTRA_TLS_CRL : path.join(dir, CRL_FILE);
    this.ca = ca;
    this.own = serialHex(new crypto.X509Certificate(cert).serialNumber);
    this.log = log;
    this.list = { serials: new Set(), number: 0, nextUpdate: 0, path: this.file, issuer: '', note: '' };
    this.stamp = stampOf(this.file);
    this.warned = 0;
    if (this.stamp) this.list = readList(this.file, ca); // throws, naming the file
    else if (this.required) throw new Error(`ASTRA_TLS_CRL: no revocation list at ${this.file}`);
    if (this.list.serials.has(this.own)) {
      throw new Error(`this node's certificate (serial ${this.own}) is revoked by ${this.file}: issue it a new one (astra tls issue)`);
    }
    if (this.list.note) log(this.list.note);
    this.warnIfDue();
  }

  // Looks at the file once a second from now on (the timer does not keep the process alive).
  watch() {
    this.timer = setInterval(() => this.look(), LOOK_MS);
    this.timer.unref();
    return this;
  }

  // The serial shown (lowercase hex) when `serial` is revoked, else '' ; a certificate whose
  // serial cannot be read counts as revoked once the list holds any (closed).
  revoked(serial) {
    if (!this.list.serials.size) return '';
    if (!serial) return 'unreadable';
    const hex = serialHex(serial);
    return this.list.serials.has(hex) ? hex : '';
  }

  look() {
    const stamp = stampOf(this.file);
    if (stamp === this.stamp) {
      this.warnIfDue();
      return;
    }
    this.stamp = stamp;
    const was = this.list;
    const holds = was.serials.size > 0;
    if (!stamp) {
      if (holds) this.log(`${this.file} was removed: its revocations stay`);
      return;
    }
    let now;
    try {
      now = readList(this.file, this.ca);
    } catch (err) {
      this.log(`${err.message}; the revocations in use stay`);
      return;
    }
    if (holds && now.note) {
      this.log(`${now.note}; the revocations before it stay`);
      return;
    }
    if (holds && now.issuer === was.issuer && now.number < was.number) {
      this.log(`${this.file} is an older list (number ${now.number} < ${was.number}): the newer one's revocations stay`);
      return;
    }
    this.list = now;
    if (now.note) this.log(now.note);
    this.log(`revocation list read again from ${this.file} (${this.list.serials.size} revoked)`);
    if (this.list.serials.has(this.own)) {
      this.log(`this node's certificate (serial ${this.own}) is revoked by ${this.file}: issue it a new one (astra tls issue)`);
    }
    this.warned = 0; // a new list: its own nextUpdate
    this.warnIfDue();
  }

  warnIfDue() {
    const due = this.list.nextUpdate;
    if (!due || due > Date.now() || Date.now() - this.warned < WARN_MS) return;
    this.warned = Date.now();
    this.log(
      `the revocation list ${this.file} is past its nextUpdate (${new Date(due).toISOString()}); ` +
        'what it revokes still holds: renew it (astra tls revoke CA_DIR) and copy it to the nodes',
    );
  }
}

// What tells the file changed: inode (a file renamed over it), size and mtime; '' when absent.
function stampOf(file) {
  try {
    const st = fs.statSync(file);
    return `${st.ino}:${st.size}:${st.mtimeMs}`;
  } catch {
    return '';
  }
}

module.exports = { Revocations };
