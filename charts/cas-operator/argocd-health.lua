-- Argo CD custom health check for serving.cas.dev/CodingAgentServing.
-- Add under resource.customizations.health.serving.cas.dev_CodingAgentServing in argocd-cm.
-- A Ready condition is trusted only when it observed the current generation.
local hs = {status = "Progressing", message = "waiting for the operator"}
if obj.status == nil or obj.status.conditions == nil then return hs end
local generation = obj.metadata.generation
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Degraded" and c.status == "True" then
    return {status = "Degraded", message = c.reason .. ": " .. (c.message or "")}
  end
end
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Ready" then
    if c.observedGeneration ~= generation then return hs end
    if c.status == "True" then return {status = "Healthy", message = c.message or ""} end
    return {status = "Progressing", message = c.message or ""}
  end
end
return hs
