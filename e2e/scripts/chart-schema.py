#!/usr/bin/env python3
# Regenerates charts/stowage/values.schema.json from values.yaml: every key typed, unknown keys
# refused at every level except maps that are the user's own (labels, annotations, Kubernetes
# objects passed through). Run it after adding a value: `python3 e2e/scripts/chart-schema.py >
# charts/stowage/values.schema.json` (helm lint --strict fails until the schema knows the value).
import yaml, json, re, sys
vals = yaml.safe_load(open('charts/stowage/values.yaml'))
# controller.controllers: the names stowage-controller accepts, read from its own tables
# (CONTROLLERS and KCM_ALIASES), each alone or negated; the chart tests compare the two.
lib = open('bins/controller/src/lib.rs').read()
def first_names(const):
    body = re.search(r'pub const %s: [^=]+= &\[(.*?)\];' % const, lib, re.S).group(1)
    return re.findall(r'\(\s*"([^"]+)"', body)
NAMES = first_names("CONTROLLERS") + first_names("KCM_ALIASES")
CONTROLLERS = ["*"] + NAMES + ["-" + n for n in NAMES]
# Maps whose keys are the user's own (labels, annotations, Kubernetes objects passed through).
FREE = {"podAnnotations","podLabels","nodeSelector","annotations","labels","parameters","resources",
        "affinity","securityContext","podSecurityContext","livenessProbe","readinessProbe","updateStrategy"}
ENUMS = {
  ("image","pullPolicy"): ["Always","IfNotPresent","Never"],
  ("tests","image","pullPolicy"): ["Always","IfNotPresent","Never"],
  ("logFormat",): ["text","json"],
  ("storageClass","volumeBindingMode"): ["Immediate","WaitForFirstConsumer"],
  ("storageClass","reclaimPolicy"): ["Delete","Retain"],
}
def schema(v, path):
    key = path[-1] if path else None
    if tuple(path) in ENUMS:
        return {"type":"string","enum":ENUMS[tuple(path)]}
    if isinstance(v, bool): return {"type":"boolean"}
    if isinstance(v, int): return {"type":"integer","minimum":0}
    if isinstance(v, float): return {"type":"number"}
    if isinstance(v, str): return {"type":"string"}
    if isinstance(v, list):
        if key == "controllers":
            return {"type":"array","items":{"type":"string","enum":CONTROLLERS},"minItems":1}
        if key == "extraArgs": return {"type":"array","items":{"type":"string"}}
        return {"type":"array","items":{"type":"object"}}
    if isinstance(v, dict):
        if key in FREE:
            return {"type":"object"}
        return {"type":"object","additionalProperties":False,
                "properties":{k: schema(x, path+[k]) for k,x in v.items()}}
    if v is None: return {}
    raise Exception(path)
s = schema(vals, [])
# Values that may be given as numbers or strings.
s["properties"]["apiServer"]["properties"]["port"] = {"type":["string","integer"]}
s["properties"]["kubeApi"]["properties"]["qps"] = {"type":["number","null"],"minimum":0}
s["properties"]["kubeApi"]["properties"]["maxQps"] = {"type":"number","exclusiveMinimum":0}
s["properties"]["logVerbosity"] = {"type":"integer","minimum":0,"maximum":10}
s["properties"]["controller"]["properties"]["replicas"] = {"type":"integer","minimum":1}
# The checker polls every 2 s; less than 10 s cannot see a claim provisioned.
s["properties"]["tests"]["properties"]["timeoutSeconds"] = {"type":"integer","minimum":10}
# agent.mode and imageStore.type are checked by the templates, whose messages say more.
s["$schema"] = "http://json-schema.org/draft-07/schema#"
s["title"] = "stowage chart values"
print(json.dumps(s, indent=2))
