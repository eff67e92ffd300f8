-- Argo CD health check for serving.cas.dev/CodingAgentServing (Lua 5.1, Argo CD's sandbox).
-- Install: resource.customizations.health.serving.cas.dev_CodingAgentServing in argocd-cm
-- (docs/architecture.md, GitOps rules). Tested by tests/unit/test_argocd_health.py against health_test.yaml.
--
-- The generation first, as Argo CD's built-in checks do: until the operator has observed the
-- spec's generation (status.observedGeneration), the status is about an older spec, so the
-- fleet is Progressing whatever it says (a Degraded for a spec the user just fixed included);
-- a condition about an older generation than the spec's is ignored. Then: Degraded when the
-- Degraded condition is True (an invalid spec, a failed apply, a fleet-wide anomaly, an
-- aborted canary); Suspended while a canary rollout is paused (a step held until promoted, an
-- inconclusive analysis, a fleet-wide anomaly); Healthy only when Ready is True, no older
-- revision is still rolling out and the stable revision is the spec's; Progressing otherwise.
-- Any field may be missing: nothing here indexes a nil.
local function conditions(o)
  if type(o.status) ~= "table" or type(o.status.conditions) ~= "table" then return {} end
  local found = {}
  for _, c in ipairs(o.status.conditions) do
    if type(c) == "table" and type(c.type) == "string" then found[c.type] = c end
  end
  return found
end

local function said(c, fallback)
  local parts = {}
  if type(c.reason) == "string" and c.reason ~= "" then table.insert(parts, c.reason) end
  if type(c.message) == "string" and c.message ~= "" then table.insert(parts, c.message) end
  if #parts == 0 then return fallback end
  return table.concat(parts, ": ")
end

local function number(v)
  if type(v) == "number" then return v end
  return nil
end

local generation = type(obj.metadata) == "table" and number(obj.metadata.generation) or nil
local conds = conditions(obj)
local status = type(obj.status) == "table" and obj.status or {}
local not_observed = {status = "Progressing",
  message = "the operator has not observed generation " .. tostring(generation) .. " yet"}

-- A condition written for the current generation (one without a generation counts as current).
local function current(c)
  local seen = number(c.observedGeneration)
  return generation == nil or seen == nil or seen >= generation
end

if next(conds) == nil then
  return {status = "Progressing", message = "waiting for the operator"}
end
local observed = number(status.observedGeneration)
if generation ~= nil and (observed == nil or observed < generation) then
  return not_observed
end
local degraded = conds["Degraded"]
if degraded ~= nil and degraded.status == "True" and current(degraded) then
  return {status = "Degraded", message = said(degraded, "degraded")}
end
local ready = conds["Ready"]
if ready == nil then
  return {status = "Progressing", message = "waiting for the operator"}
end
if not current(ready) then
  return not_observed
end
local rollout = type(status.rollout) == "table" and status.rollout or {}
if rollout.phase == "Paused" then
  local why = type(rollout.reason) == "string" and rollout.reason or "paused"
  return {status = "Suspended", message = "canary rollout paused: " .. why}
end
if ready.status ~= "True" then
  return {status = "Progressing", message = said(ready, "not ready")}
end
local progressing = conds["Progressing"]
if progressing ~= nil and progressing.status == "True" then
  return {status = "Progressing", message = said(progressing, "rolling out")}
end
if type(rollout.stableRevision) == "string" and type(status.revision) == "string"
    and rollout.stableRevision ~= status.revision then
  return {status = "Progressing", message = "serving revision " .. rollout.stableRevision .. ", the spec's is " .. status.revision}
end
local message = said(ready, "ready")
if type(status.heldRevision) == "table" and type(status.heldRevision.revision) == "string" then
  message = message .. "; an operator upgrade is held (would roll to revision " .. status.heldRevision.revision .. ")"
end
return {status = "Healthy", message = message}
