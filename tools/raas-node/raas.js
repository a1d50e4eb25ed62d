#!/usr/bin/env node
'use strict';
// A RaaS in JavaScript: astra.raas.v1.RolloutService on @grpc/grpc-js, from the .proto files
// alone (no Astra code), with grpc.health.v1 and server reflection, registered with Dataflow.
// A deterministic generator stands in for the model (generator.js); LoadWeights fetches and
// verifies real versions from a WeightService (weights.js).
//
//   node tools/raas-node/raas.js --dataflow HOST:PORT --port 0 --capacity 16 \
//       --policy policy --workflow single_turn --delay-ms 50 --instance-id node-0
//
// Prints one JSON line {"service": "raas", "address": ..., "instance_id": ...} on stdout once
// it serves, logs on stderr, and on SIGTERM/SIGINT reports NOT_SERVING, deregisters, drains
// for --grace-s and exits 0.

const crypto = require('crypto');
const { parseArgs } = require('util');
const grpc = require('@grpc/grpc-js');
const { HealthImplementation } = require('grpc-health-check');
const { ReflectionService } = require('@grpc/reflection');
const protos = require('./protos');
const tls = require('./tls');
const { Raas } = require('./service');
const { Registrar } = require('./registrar');

const SERVICE = 'astra.raas.v1.RolloutService';
const USAGE = `usage: raas.js [--dataflow HOST:PORT] [--host H] [--port P] [--capacity N]
  [--policy P]... [--workflow W]... [--reward R]... [--delay-ms MS] [--tokens N] [--vocab N]
  [--instance-id ID] [--label K=V]... [--include DIR]... [--grace-s S] [--tls-dir DIR]`;

function options(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      dataflow: { type: 'string', default: '' },
      host: { type: 'string', default: '127.0.0.1' },
      port: { type: 'string', default: '0' },
      capacity: { type: 'string', default: '16' },
      policy: { type: 'string', multiple: true, default: [] },
      workflow: { type: 'string', multiple: true, default: [] },
      reward: { type: 'string', multiple: true, default: [] },
      'delay-ms': { type: 'string', default: '50' },
      tokens: { type: 'string', default: '0' },
      vocab: { type: 'string', default: '256' },
      'instance-id': { type: 'string', default: '' },
      label: { type: 'string', multiple: true, default: [] },
      include: { type: 'string', multiple: true, default: [] },
      'grace-s': { type: 'string', default: '2' },
      'tls-dir': { type: 'string', default: process.env.ASTRA_TLS_DIR || '' },
      help: { type: 'boolean', default: false },
    },
  });
  if (values.help) {
    process.stdout.write(`${USAGE}\n`);
    process.exit(0);
  }
  const int = (name, min) => {
    const n = Number(values[name]);
    if (!Number.isInteger(n) || n < min) usage(`--${name} must be an integer >= ${min}, got ${values[name]}`);
    return n;
  };
  const labels = {};
  for (const item of values.label) {
    const at = item.indexOf('=');
    if (at < 1) usage(`--label: expected K=V, got ${item}`);
    labels[item.slice(0, at)] = item.slice(at + 1);
  }
  return {
    dataflow: values.dataflow,
    host: values.host,
    port: int('port', 0),
    capacity: int('capacity', 1),
    policies: values.policy.length ? values.policy : ['policy'],
    workflows: values.workflow.length ? values.workflow : ['single_turn'],
    rewards: values.reward,
    delayMs: int('delay-ms', 0),
    tokens: int('tokens', 0),
    vocab: int('vocab', 1),
    instanceId: values['instance-id'],
    labels,
    include: values.include,
    graceS: Number(values['grace-s']),
    tlsDir: values['tls-dir'],
  };
}

function usage(message) {
  process.stderr.write(`raas.js: ${message}\n${USAGE}\n`);
  process.exit(2);
}

function log(message) {
  process.stderr.write(`${new Date().toISOString()} raas-node: ${message}\n`);
}

function bind(server, address, credentials) {
  return new Promise((resolve, reject) =>
    server.bindAsync(address, credentials, (err, port) => (err ? reject(err) : resolve(port))),
  );
}

async function main() {
  const opts = options(process.argv.slice(2));
  const proto = protos.load(opts.include);
  const creds = tls.load(opts.tlsDir, { rpcError: proto.details, log });
  proto.clientCredentials = creds.client;
  const server = new grpc.Server({
    interceptors: creds.interceptors, // under mutual TLS: revoked callers and roles refused
    'grpc.max_receive_message_length': 64 << 20,
    'grpc.max_send_message_length': 64 << 20,
  });
  const port = await bind(server, `${opts.host}:${opts.port}`, creds.server);
  opts.address = `${opts.host}:${port}`;
  opts.instanceId = opts.instanceId || `${opts.address}-${crypto.randomBytes(4).toString('hex')}`;

  const raas = new Raas(opts, proto, log);
  server.addService(proto.RolloutService.service, raas.handlers());
  const health = new HealthImplementation({ '': 'SERVING', [SERVICE]: 'SERVING' });
  health.addToServer(server);
  new ReflectionService(proto.served).addToServer(server);

  const registrar = opts.dataflow ? new Registrar(proto, opts.dataflow, raas, log) : null;
  process.stdout.write(`${JSON.stringify({ service: 'raas', address: opts.address, instance_id: opts.instanceId })}\n`);
  const tlsNote = creds.on ? `, mutual TLS (${creds.revocations.list.serials.size} revoked)` : '';
  log(`serving ${SERVICE} on ${opts.address} as ${opts.instanceId}, capacity ${opts.capacity}${tlsNote}`);

  let stopping = false;
  const stop = async (signal) => {
    if (stopping) return;
    stopping = true;
    log(`${signal}: draining`);
    health.setStatus('', 'NOT_SERVING');
    health.setStatus(SERVICE, 'NOT_SERVING');
    if (registrar) await registrar.stop();
    const force = setTimeout(() => {
      server.forceShutdown(); // calls still open past the grace period
      process.exit(0);
    }, opts.graceS * 1000);
    server.tryShutdown(() => {
      clearTimeout(force);
      process.exit(0);
    });
  };
  process.on('SIGTERM', () => stop('SIGTERM'));
  process.on('SIGINT', () => stop('SIGINT'));
  if (registrar) {
    registrar.start().catch((err) => {
      log(err.message);
      process.exit(1);
    });
  }
}

main().catch((err) => {
  log(err.stack || String(err));
  process.exit(1);
});
