'use strict';
// Which RolloutService calls a caller may make, by the roles its certificate names (docs/deployment.md,
// "Mutual TLS"; astra/authz.py holds the table for all four services, and
// tests/test_raas_node.py holds this one to it). A certificate names roles as URI
// subjectAltNames urn:astra:role:<role>; one that names none (an operator's, or one made
// before roles existed) or names admin may call everything. Health checking and reflection are
// open to every certificate of the CA (tls.js lets them through before this is asked). A
// method the table does not know is refused to every role but admin (fail closed). The RaaS
// methods name no policy a scope would confine (astra/scopes.py): Dataflow's calls to a RaaS.

const ROLE_URI = 'urn:astra:role:';
const ADMIN = 'admin';
const ANYONE = '*';
const SERVICE = '/astra.raas.v1.RolloutService/';

// Roles that may call each RPC, besides admin (and role-less certificates).
const PERMITTED = Object.fromEntries(
  Object.entries({
    SubmitGroups: ['dataflow'],
    CollectResults: ['dataflow'],
    AckResults: ['dataflow'],
    CollectResultBatch: ['dataflow'],
    CancelGroups: ['dataflow'],
    LoadWeights: ['dataflow'],
    GetStatus: [ANYONE],
    GetCapabilities: [ANYONE],
  }).map(([name, roles]) => [SERVICE + name, roles]),
);

// The roles of a peer certificate as Node shows it (`subjectaltname`: "URI:..., IP
// Address:..."); other names are ignored.
function rolesOf(cert) {
  const names = String((cert && cert.subjectaltname) || '').split(/,\s*/);
  const roles = names.filter((n) => n.startsWith(`URI:${ROLE_URI}`)).map((n) => n.slice(4 + ROLE_URI.length));
  return [...new Set(roles)].sort();
}

// null when a caller with `roles` may call `method`, else the refusal's message and metadata.
function denial(method, roles) {
  if (!roles.length || roles.includes(ADMIN)) return null;
  const allowed = PERMITTED[method];
  if (allowed && (allowed.includes(ANYONE) || allowed.some((r) => roles.includes(r)))) return null;
  const may = allowed ? [...allowed].sort().concat(ADMIN).join(', ') : ADMIN;
  return {
    message: `${method}: a certificate with role ${roles.join(', ')} may not call it (roles that may: ${may})`,
    metadata: { method, roles: roles.join(','), permitted: may },
  };
}

module.exports = { PERMITTED, rolesOf, denial };
