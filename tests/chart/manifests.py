"""Offline validation of rendered manifests.

Built-in kinds: the Kubernetes OpenAPI schemas shipped by `kubernetes-validate`, in strict mode
(an unknown field is an error, as `kubectl apply --validate=strict` would say), for the oldest
Kubernetes the chart supports and the newest the package knows (a kind the chart renders only from
some version on, e.g. ValidatingAdmissionPolicy v1 from 1.30, is checked against the versions that
have it: `problems(doc, versions)`). The prometheus-operator and cert-manager kinds are not in those
schemas; they are checked against the structure below: the fields this chart uses, with their CRD
types, and nothing else (a misspelt field fails).
"""

from __future__ import annotations

import jsonschema
import kubernetes_validate

KUBE_VERSIONS = ("1.27", kubernetes_validate.latest_version())
ADMISSION_POLICY_VERSIONS = ("1.30", kubernetes_validate.latest_version())  # ValidatingAdmissionPolicy v1

_DNS1123 = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
_METADATA = {
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": _DNS1123, "maxLength": 253},
                   "namespace": {"type": "string", "pattern": _DNS1123}, "labels": _STRINGS, "annotations": _STRINGS},
}
_RELABEL = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": _LABEL_NAME}, "separator": {"type": "string"},
        "targetLabel": {"type": "string"}, "regex": {"type": "string"}, "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                            "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
                            "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal", "KeepEqual",
                            "dropequal", "DropEqual"]},
    },
}


_SECRET_KEY = {"type": "object", "required": ["key"], "additionalProperties": False,
               "properties": {"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}}}
_CERT_USAGES = ["signing", "digital signature", "content commitment", "key encipherment", "key agreement",
                "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth",
                "client auth", "code signing", "email protection", "s/mime", "ipsec end system", "ipsec tunnel",
                "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"]
_GO_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"}


def _crd(kind: str, spec: dict, api_version: str = "monitoring.coreos.com/v1") -> dict:
    return {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind},
                       "metadata": _METADATA, "spec": spec},
    }


CRD_SCHEMAS = {
    "ServiceMonitor": _crd("ServiceMonitor", {
        "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
        "properties": {
            "selector": {"type": "object", "additionalProperties": False, "minProperties": 1,
                         "properties": {"matchLabels": _STRINGS, "matchExpressions": {"type": "array"}}},
            "namespaceSelector": {"type": "object", "additionalProperties": False,
                                  "properties": {"any": {"type": "boolean"},
                                                 "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "jobLabel": {"type": "string"},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["port"],
                "properties": {
                    "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                    "scheme": {"enum": ["http", "https"]}, "interval": _DURATION, "scrapeTimeout": _DURATION,
                    "honorLabels": {"type": "boolean"}, "honorTimestamps": {"type": "boolean"},
                    "relabelings": {"type": "array", "items": _RELABEL},
                    "metricRelabelings": {"type": "array", "items": _RELABEL},
                    "tlsConfig": {"type": "object", "additionalProperties": False, "properties": {
                        "ca": {"type": "object", "additionalProperties": False, "maxProperties": 1,
                               "properties": {"secret": _SECRET_KEY, "configMap": _SECRET_KEY}},
                        "serverName": {"type": "string"}, "insecureSkipVerify": {"type": "boolean"}}},
                    "bearerTokenFile": {"type": "string"},
                    "authorization": {"type": "object", "additionalProperties": False, "properties": {
                        "type": {"type": "string"}, "credentials": _SECRET_KEY}},
                },
                "not": {"required": ["bearerTokenFile", "authorization"]},
            }},
        },
    }),
    "Certificate": _crd("Certificate", {
        "type": "object", "required": ["secretName", "issuerRef"], "additionalProperties": False,
        "anyOf": [{"required": [name]} for name in ("commonName", "dnsNames", "uris", "emailAddresses", "ipAddresses")],
        "properties": {
            "secretName": {"type": "string", "pattern": _DNS1123},
            "issuerRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                          "properties": {"name": {"type": "string", "minLength": 1}, "kind": {"type": "string"},
                                         "group": {"type": "string"}}},
            "commonName": {"type": "string"}, "duration": _GO_DURATION, "renewBefore": _GO_DURATION,
            "dnsNames": {"type": "array", "minItems": 1, "items": {"type": "string", "pattern": _DNS1123}},
            "usages": {"type": "array", "items": {"enum": _CERT_USAGES}},
            "privateKey": {"type": "object", "additionalProperties": False, "properties": {
                "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]}, "size": {"type": "integer"},
                "encoding": {"enum": ["PKCS1", "PKCS8"]}, "rotationPolicy": {"enum": ["Never", "Always"]}}},
        },
    }, api_version="cert-manager.io/v1"),
    "PrometheusRule": _crd("PrometheusRule", {
        "type": "object", "required": ["groups"], "additionalProperties": False,
        "properties": {"groups": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "rules"], "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "minLength": 1}, "interval": _DURATION, "limit": {"type": "integer"},
                "query_offset": _DURATION, "labels": _STRINGS,
                "rules": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["expr"], "additionalProperties": False,
                    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
                    "properties": {
                        "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
                        "alert": {"type": "string", "minLength": 1},
                        "expr": {"type": ["string", "integer"]}, "for": _DURATION, "keep_firing_for": _DURATION,
                        "labels": _STRINGS, "annotations": _STRINGS,
                    },
                }},
            },
        }}},
    }),
}


def problems(doc: dict, versions: tuple[str, ...] = KUBE_VERSIONS) -> list[str]:
    """Every schema violation of one rendered document, as readable lines (built-in kinds: for each
    Kubernetes version of `versions`)."""
    kind = doc.get("kind", "?")
    where = f"{kind} {doc.get('metadata', {}).get('name', '?')}"
    if kind in CRD_SCHEMAS:
        validator = jsonschema.Draft202012Validator(CRD_SCHEMAS[kind])
        return [f"{where}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                for e in validator.iter_errors(doc)]
    found = []
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(map(str, exc.path)) or "(top)"
            found.append(f"{where} (Kubernetes {version}): {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            found.append(f"{where}: no schema for {doc.get('apiVersion')} {kind} in Kubernetes {version}")
    return found
