'use strict';
// The contracts as Node sees them: proto/ loaded at run time with @grpc/proto-loader (no
// generated code), and google.rpc.Status with its details (ErrorInfo, BadRequest, RetryInfo)
// encoded with protobufjs for the grpc-status-details-bin trailer every Astra error carries.

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const REPO = path.resolve(__dirname, '..', '..');
// proto/ holds Astra's contracts; build/protodeps the google/rpc protos they import
// (written by `python tools/codegen.py --deps`).
const DEFAULT_INCLUDES = [path.join(REPO, 'proto'), path.join(REPO, 'build', 'protodeps')];

const LOADER_OPTIONS = {
  keepCase: true, // field names as in the .proto files (snake_case)
  longs: Number, // every int64 here (versions, sizes, shapes) is far below 2^53
  enums: String,
  defaults: true,
  arrays: true,
  objects: true,
  oneofs: true, // a oneof's set field is named in `part`
};

function includeDirs(extra) {
  const dirs = [...(extra || []), ...DEFAULT_INCLUDES];
  const missing = ['google/rpc/status.proto'].filter(
    (f) => !dirs.some((d) => fs.existsSync(path.join(d, f))),
  );
  if (missing.length) {
    throw new Error(
      `cannot find ${missing.join(', ')} under ${dirs.join(', ')}: run ` +
        '`python tools/codegen.py --deps` in the repository first',
    );
  }
  return dirs;
}

// The package definitions: `all` for the clients (Dataflow, WeightService) and the server,
// `served` (rollout_service.proto alone) for reflection, which lists what it is given.
function load(extraIncludes) {
  const dirs = includeDirs(extraIncludes);
  const opts = { ...LOADER_OPTIONS, includeDirs: dirs };
  const all = protoLoader.loadSync(
    [
      'astra/raas/v1/rollout_service.proto',
      'astra/dataflow/v1/dataflow_service.proto',
      'astra/weights/v1/weight_service.proto',
    ],
    opts,
  );
  const served = protoLoader.loadSync(['astra/raas/v1/rollout_service.proto'], opts);
  const api = grpc.loadPackageDefinition(all);
  return {
    all,
    served,
    RolloutService: api.astra.raas.v1.RolloutService,
    DataflowService: api.astra.dataflow.v1.DataflowService,
    WeightService: api.astra.weights.v1.WeightService,
    details: statusDetails(dirs),
    clientCredentials: () => grpc.credentials.createInsecure(), // tls.js replaces it
  };
}

// google.rpc.Status encoding: ErrorInfo always, BadRequest when a field is named, RetryInfo
// when the caller should come back later.
function statusDetails(dirs) {
  const root = new protobuf.Root();
  root.resolvePath = (_origin, target) => {
    const found = dirs.map((d) => path.join(d, target)).find((p) => fs.existsSync(p));
    return found || target; // google/protobuf/*: protobufjs carries those itself
  };
  root.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto']);
  const Status = root.lookupType('google.rpc.Status');

  function any(typeName, fields) {
    const type = root.lookupType(typeName);
    return {
      type_url: `type.googleapis.com/${typeName}`, // protobufjs keeps Any's names as written
      value: type.encode(type.fromObject(fields)).finish(),
    };
  }

  // An error for a grpc-js callback (or call.emit('error')): code, message, and the details
  // trailer. `field` names the request field at fault, `retryAfterS` sets RetryInfo.
  return function rpcError(code, message, reason, { domain, field, retryAfterS, metadata } = {}) {
    const info = { reason, domain: domain || 'astra.raas.v1', metadata: { ...(metadata || {}) } };
    if (field) info.metadata.field = field;
    const details = [any('google.rpc.ErrorInfo', info)];
    if (field) {
      details.push(
        any('google.rpc.BadRequest', { fieldViolations: [{ field, description: message }] }),
      );
    }
    if (retryAfterS) {
      const seconds = Math.floor(retryAfterS);
      const nanos = Math.round((retryAfterS - seconds) * 1e9);
      details.push(any('google.rpc.RetryInfo', { retryDelay: { seconds, nanos } }));
    }
    const status = Status.encode(Status.fromObject({ code, message, details })).finish();
    const md = new grpc.Metadata();
    md.set('grpc-status-details-bin', Buffer.from(status));
    return { code, details: message, metadata: md };
  };
}

function durationS(d) {
  return d ? Number(d.seconds || 0) + Number(d.nanos || 0) / 1e9 : 0;
}

module.exports = { load, durationS, REPO };
