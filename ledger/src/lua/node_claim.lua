-- Claim or renew a node id's lease (the heartbeat). The lease names its holder as
-- `host|instance`; it expires `ttl_ms` after the last renewal, and while it exists the node is
-- live. A vacant lease is taken. At start ('start'), a lease held by another instance on the
-- same host is taken over (a restart within node_down_after); any other holder keeps it.
-- KEYS: sbs, lease
-- ARGV: holder, ttl_ms, mode ('start' | 'renew')
-- Reply (`NodeClaim`): claimed {fresh, known} | held {by, ttl_ms}
--   fresh: the lease was vacant (the node was down, or the ledger lost it);
--   known: the ledger records sandboxes of this node (false after Redis lost its data).
local holder, ttl, mode = ARGV[1], ARGV[2], ARGV[3]
local cur = redis.call('GET', K.lease())
local function host_of(h) return string.match(h, '^(.*)|[^|]*$') end
if cur and cur ~= holder and not (mode == 'start' and host_of(cur) == host_of(holder)) then
  return reply({ outcome = 'held', by = cur, ttl_ms = redis.call('PTTL', K.lease()) })
end
redis.call('SET', K.lease(), holder, 'PX', ttl)
return reply({ outcome = 'claimed', fresh = not cur, known = redis.call('EXISTS', K.sbs()) == 1 })
