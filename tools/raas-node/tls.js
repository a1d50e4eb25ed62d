'use strict';
// Mutual TLS as Astra's nodes use it (README "Mutual TLS"): a directory holding the run CA's
// ca.pem and this node's cert.pem and key.pem, from --tls-dir or ASTRA_TLS_DIR. The server
// requires client certificates of that CA; the clients (Dataflow, WeightService) present the
// same certificate and check their server's against ca.pem. Without a directory: plaintext.
// Not here: the CA's revocation list (crl.pem) and the role rules of the certificates.

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');

function load(dir) {
  if (!dir) {
    return { server: grpc.ServerCredentials.createInsecure(), client: () => grpc.credentials.createInsecure(), on: false };
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
  return {
    server: grpc.ServerCredentials.createSsl(ca, [{ private_key: key, cert_chain: cert }], true),
    client: () => grpc.credentials.createSsl(ca, key, cert),
    on: true,
  };
}

module.exports = { load };
