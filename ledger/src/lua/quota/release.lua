-- Give leases back (idempotent: a lease already given back is skipped).
-- ARGV: lease ids
-- Reply: {released}
local n = 0
for _, id in ipairs(ARGV) do
  if give_back(id) then n = n + 1 end
end
return cjson.encode({ released = n })
