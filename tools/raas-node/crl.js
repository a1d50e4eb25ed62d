'use strict';
// The CA's revocation list (an X.509 CRL, RFC 5280 section 5) read with a DER reader of its
// own: Node's crypto verifies signatures but parses no CRL. `readList` returns the serial
// numbers a list signed by a CA of ca.pem revokes, its CRLNumber and its nextUpdate; a list
// naming a CA of ca.pem as its issuer that this CA did not sign is refused (an Error naming
// the file); the list of a CA ca.pem does not hold is not used (`note` says why), as in
// astra/tls_crl.py.

const crypto = require('crypto');
const fs = require('fs');

const TAG = { INTEGER: 0x02, BIT_STRING: 0x03, OCTETS: 0x04, OID: 0x06, SEQUENCE: 0x30 };
const UTC_TIME = 0x17;
const GENERALIZED_TIME = 0x18;
const CONTEXT_0 = 0xa0; // [0], constructed: a CRL's extensions, a certificate's version
const CRL_NUMBER = '2.5.29.20';
const HASH_OF = {
  '1.2.840.10045.4.3.2': 'sha256', // ecdsa-with-SHA256 (signature DER-encoded: verify's default)
  '1.2.840.10045.4.3.3': 'sha384',
  '1.2.840.10045.4.3.4': 'sha512',
  '1.2.840.113549.1.1.11': 'sha256', // sha256WithRSAEncryption
  '1.2.840.113549.1.1.12': 'sha384',
  '1.2.840.113549.1.1.13': 'sha512',
  '1.3.101.112': null, // Ed25519: no separate hash
};
const NAMES = { '2.5.4.3': 'CN', '2.5.4.6': 'C', '2.5.4.7': 'L', '2.5.4.8': 'ST', '2.5.4.10': 'O', '2.5.4.11': 'OU' };

// One DER element at `at`: its tag, content bounds, and its whole encoding (`raw`).
function element(buf, at, end = buf.length) {
  if (at + 2 > end) throw new Error('DER: truncated');
  const tag = buf[at];
  let len = buf[at + 1];
  let start = at + 2;
  if (len & 0x80) {
    const n = len & 0x7f;
    if (n < 1 || n > 4 || start + n > end) throw new Error('DER: bad length');
    len = 0;
    for (let i = 0; i < n; i++) len = len * 256 + buf[start + i];
    start += n;
  }
  if (start + len > end) throw new Error('DER: element past its end');
  return { tag, start, end: start + len, raw: buf.subarray(at, start + len), buf };
}

// The elements inside a constructed one.
function children(el) {
  const out = [];
  for (let at = el.start; at < el.end; ) {
    const child = element(el.buf, at, el.end);
    out.push(child);
    at = child.end;
  }
  return out;
}

function expect(el, tag, what) {
  if (!el || el.tag !== tag) throw new Error(`DER: ${what} expected`);
  return el;
}

function content(el) {
  return el.buf.subarray(el.start, el.end);
}

function oid(el) {
  const bytes = content(expect(el, TAG.OID, 'an object identifier'));
  const parts = [];
  let value = 0;
  for (const b of bytes) {
    value = value * 128 + (b & 0x7f);
    if (!(b & 0x80)) {
      const first = Math.min(2, Math.floor(value / 40)); // the first byte holds two arcs
      parts.push(...(parts.length ? [value] : [first, value - 40 * first]));
      value = 0;
    }
  }
  return parts.join('.');
}

// A serial number as Node shows certificates' (lowercase here), without leading zeros.
function serialHex(hex) {
  return String(hex).toLowerCase().replace(/^0+(?=.)/, '');
}

function time(el) {
  const s = content(el).toString('latin1');
  const m = /^(\d{2}|\d{4})(\d{2})(\d{2})(\d{2})(\d{2})(\d{2})(?:\.\d+)?Z$/.exec(s);
  if (!m || (el.tag === UTC_TIME) !== (m[1].length === 2)) throw new Error(`DER: bad time ${s}`);
  let year = Number(m[1]);
  if (el.tag === UTC_TIME) year += year < 50 ? 2000 : 1900;
  return Date.UTC(year, m[2] - 1, m[3], m[4], m[5], m[6]);
}

const isTime = (el) => el && (el.tag === UTC_TIME || el.tag === GENERALIZED_TIME);

// A Name as RFC 4514 writes it (the attributes it knows by name; others by OID).
function nameText(el) {
  const rdns = children(el).map((set) =>
    children(set)
      .map((pair) => {
        const [type, value] = children(pair);
        return `${NAMES[oid(type)] || oid(type)}=${content(value).toString('utf8')}`;
      })
      .join('+'),
  );
  return rdns.reverse().join(',');
}

function parseCrl(der) {
  const [tbs, sigAlg, sigValue] = children(expect(element(der, 0), TAG.SEQUENCE, 'CertificateList'));
  const fields = children(expect(tbs, TAG.SEQUENCE, 'tbsCertList'));
  let i = fields[0] && fields[0].tag === TAG.INTEGER ? 1 : 0; // version (v2), optional
  const inner = expect(fields[i++], TAG.SEQUENCE, 'signature algorithm');
  const issuer = expect(fields[i++], TAG.SEQUENCE, 'issuer');
  if (!isTime(fields[i])) throw new Error('DER: thisUpdate expected');
  const thisUpdate = time(fields[i++]);
  const nextUpdate = isTime(fields[i]) ? time(fields[i++]) : 0;
  const serials = new Set();
  if (fields[i] && fields[i].tag === TAG.SEQUENCE) {
    for (const entry of children(fields[i++])) {
      const serial = expect(children(entry)[0], TAG.INTEGER, 'a serial number');
      serials.add(serialHex(content(serial).toString('hex')));
    }
  }
  let number = 0;
  if (fields[i] && fields[i].tag === CONTEXT_0) {
    for (const ext of children(expect(children(fields[i++])[0], TAG.SEQUENCE, 'extensions'))) {
      const parts = children(ext);
      if (oid(parts[0]) !== CRL_NUMBER) continue;
      const value = element(content(expect(parts[parts.length - 1], TAG.OCTETS, 'extnValue')), 0);
      number = parseInt(content(expect(value, TAG.INTEGER, 'CRLNumber')).toString('hex') || '0', 16);
    }
  }
  if (i !== fields.length) throw new Error('DER: unexpected field in tbsCertList');
  if (!inner.raw.equals(expect(sigAlg, TAG.SEQUENCE, 'signatureAlgorithm').raw)) {
    throw new Error('the two signature algorithms differ');
  }
  const bits = content(expect(sigValue, TAG.BIT_STRING, 'signatureValue'));
  return {
    tbs: tbs.raw,
    algorithm: oid(children(sigAlg)[0]),
    signature: bits.subarray(1), // after the count of unused bits (0)
    issuer: issuer.raw,
    issuerText: nameText(issuer),
    thisUpdate,
    nextUpdate,
    serials,
    number,
  };
}

function pemBlocks(text, kind) {
  const re = new RegExp(`-----BEGIN ${kind}-----([^-]*)-----END ${kind}-----`, 'g');
  return [...String(text).matchAll(re)].map((m) => Buffer.from(m[1].replace(/\s+/g, ''), 'base64'));
}

// The CAs of ca.pem: each one's subject (DER, to match a list's issuer) and public key.
function authorities(caPem) {
  return pemBlocks(caPem, 'CERTIFICATE').map((der) => {
    const fields = children(children(element(der, 0))[0]);
    const at = fields[0].tag === CONTEXT_0 ? 1 : 0; // version [0], optional
    return { subject: fields[at + 4].raw, key: new crypto.X509Certificate(der).publicKey };
  });
}

function signedBy(crl, ca) {
  if (!(crl.algorithm in HASH_OF)) return false;
  try {
    return crypto.verify(HASH_OF[crl.algorithm], crl.tbs, ca.key, crl.signature);
  } catch {
    return false; // a key of another type than the signature's
  }
}

// The list in `file` as this node uses it: {serials, number, nextUpdate (ms, 0: none), path,
// issuer (hex of its DER name), note}. Throws an Error naming the file when it cannot be read,
// is not one CRL, or its issuer is a CA of ca.pem that did not sign it.
function readList(file, caPem) {
  let crl;
  try {
    const blocks = pemBlocks(fs.readFileSync(file, 'latin1'), 'X509 CRL');
    if (blocks.length !== 1) throw new Error(`holds ${blocks.length} CRLs, not one (X509 CRL PEM)`);
    crl = parseCrl(blocks[0]);
  } catch (err) {
    throw new Error(`${file}: ${err.message}`);
  }
  const issuers = authorities(caPem).filter((ca) => ca.subject.equals(crl.issuer));
  const { serials, number, nextUpdate } = crl;
  const list = { serials, number, nextUpdate, path: file, issuer: crl.issuer.toString('hex'), note: '' };
  if (!issuers.length) {
    const note = `${file} is the list of ${crl.issuerText}, a CA ca.pem does not trust: not used`;
    return { ...list, serials: new Set(), number: 0, nextUpdate: 0, note };
  }
  if (!issuers.some((ca) => signedBy(crl, ca))) {
    throw new Error(
      `${file}: not signed by the CA of ca.pem (issuer ${crl.issuerText}): a revocation list ` +
        'counts only from the CA that issued the certificates',
    );
  }
  return list;
}

module.exports = { readList, parseCrl, serialHex };
