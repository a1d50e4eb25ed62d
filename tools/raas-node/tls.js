'use strict';
// Mutual TLS as Astra's nodes use it (docs/deployment.md, "Mutual TLS"): a directory holding the run CA's
// ca.pem and this node's cert.pem and key.pem, from --tls-dir or ASTRA_TLS_DIR. The server
// requires client certificates of that CA; the clients (Dataflow, WeightService) present the
// same certificate and check their server's against ca.pem. Without a directory: plaintext.
// The CA's revocation list (revocations.js: ASTRA_TLS_CRL, else crl.pem in the directory) is
// checked on both sides: a call from a listed client ends UNAUTHENTICATED (ErrorInfo reason
// CERTIFICATE_REVOKED, naming the serial and the method) as it starts and at each message it
// sends, health checking and reflection excepted; a connection to a listed server is refused
// in the handshake (its calls end UNAVAILABLE, naming the serial). The roles a caller's
// certificate names are checked as each call starts (roles.js): a call its roles do not permit
// ends PERMISSION_DENIED (ErrorInfo reason ROLE_NOT_PERMITTED, naming the method, the roles and
// the roles that may).

const fs = require('fs');
const nodeTls = require('tls');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const { Revocations } = require('./revocations');
const { denial, rolesOf } = require('./roles');

const OPEN = ['/grpc.health.v1.Health/', '/grpc.reflection.']; // open to any certificate

// `rpcError`: protos.js's error builder (the refusal's ErrorInfo trailer); `log`: a line.
function load(dir, { rpcError, log } = {}) {
  if (!dir) {
    return { server: grpc.ServerCredentials.createInsecure(), client: () => grpc.credentials.createInsecure(), interceptors: [], on: false };
  }
  const read = (name) => {
    const file = path.join(dir, name);
    try {
      return fs.readFileSync(file);
    } catch (err) {
      throw new Error(`TLS directory ${dir}: cannot read ${name}: ${err.message}`);
    }
  };
  const [ca, cert, key] = ['ca.pem', 'cert.pem', 'key.pem'].map(read);
  const revocations = new Revocations(dir, ca, cert, log || (() => {})).watch();
  return {
    server: grpc.ServerCredentials.createSsl(ca, [{ private_key: key, cert_chain: cert }], true),
    client: () => grpc.credentials.createSsl(ca, key, cert, { checkServerIdentity: serverCheck(revocations) }),
    interceptors: [guardCalls(revocations, rpcError)],
    revocations,
    on: true,
  };
}

// A client's check of its server: the usual host name check, then the revocation list.
function serverCheck(revocations) {
  return (host, cert) => {
    const err = nodeTls.checkServerIdentity(host, cert);
    if (err) return err;
    const serial = revocations.revoked(cert && cert.serialNumber);
    if (!serial) return undefined;
    return new Error(`the server's certificate at ${host} (serial ${serial}) is revoked by ${revocations.file}`);
  };
}

// A server interceptor: each call of a revoked client ends UNAUTHENTICATED before its handler
// sees it, or at its next message when the list names it later; a call the caller's roles do
// not permit ends PERMISSION_DENIED as it starts.
function guardCalls(revocations, rpcError) {
  const logged = new Set();
  return (method, call) => {
    if (OPEN.some((prefix) => method.path.startsWith(prefix))) return new grpc.ServerInterceptingCall(call);
    const refusal = () => {
      const peer = call.getAuthContext().sslPeerCertificate;
      const serial = revocations.revoked(peer && peer.serialNumber);
      if (!serial) return null;
      if (!logged.has(method.path)) {
        logged.add(method.path); // the first refusal of each method
        revocations.log(`refused ${method.path} to ${call.getPeer()}: its certificate (serial ${serial}) is revoked`);
      }
      const message =
        `${method.path}: the caller's certificate (serial ${serial}) is revoked by the CA's ` +
        'revocation list (or could not be read to tell): its holder needs a new one (astra tls issue)';
      const domain = method.path.replace(/^\//, '').split('/')[0].replace(/\.[^.]*$/, '');
      return rpcError(grpc.status.UNAUTHENTICATED, message, 'CERTIFICATE_REVOKED', {
        domain,
        metadata: { method: method.path, serial },
      });
    };
    // The roles the caller's certificate names, checked as the call starts (roles.js).
    const forbidden = () => {
      const denied = denial(method.path, rolesOf(call.getAuthContext().sslPeerCertificate));
      if (!denied) return null;
      const domain = method.path.replace(/^\//, '').split('/')[0].replace(/\.[^.]*$/, '');
      return rpcError(grpc.status.PERMISSION_DENIED, denied.message, 'ROLE_NOT_PERMITTED', {
        domain,
        metadata: denied.metadata,
      });
    };
    const guarded = (check) => (value, pass) => {
      const refused = check();
      if (refused) call.sendStatus(refused);
      else pass(value);
    };
    const atStart = guarded(() => refusal() || forbidden());
    return new grpc.ServerInterceptingCall(call, {
      start: (next) => next({ onReceiveMetadata: atStart, onReceiveMessage: guarded(refusal) }),
    });
  };
}

module.exports = { load };
