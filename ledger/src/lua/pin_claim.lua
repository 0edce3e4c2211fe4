-- Claim a tenant's session key for a session about to be created (not a node script).
-- KEYS: pin
-- ARGV: claim token, pending ttl ms
-- Reply (`PinClaim`): claimed | existing {session_id} | pending {claim}
local cur = redis.call('GET', KEYS[1])
if not cur then
  redis.call('SET', KEYS[1], 'pending:' .. ARGV[1], 'PX', tonumber(ARGV[2]))
  return cjson.encode({ outcome = 'claimed' })
end
if string.sub(cur, 1, 8) == 'pending:' then
  return cjson.encode({ outcome = 'pending', claim = string.sub(cur, 9) })
end
return cjson.encode({ outcome = 'existing', session_id = cur })
