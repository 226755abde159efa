-- fleetlimit: slots of a concurrency limit, held by requests in flight across the fleet.
--
-- KEYS[1]: the sorted set of slots held for one key (member: slot id, score: its expiry in µs).
-- ARGV[1]: 'acquire' | 'renew' | 'release'
-- ARGV[2]: now in µs, or '' to read the server's clock (the fleet's one clock).
-- ARGV[3]: the slot's id. ARGV[4]: the limit. ARGV[5]: how long a slot lives unless renewed (µs).
-- A slot whose holder died (no renewal) expires by itself: expired slots are dropped first.
-- Returns {1 if acquired / renewed (0: held again, lost) / released, slots held after the call}.

-- A script that reads TIME and then writes needs its effects replicated: the default since
-- Redis 5.0, but 5.0 to 6.2 can be configured otherwise (`lua-replicate-commands no`), which
-- would refuse every write here. Asked for explicitly (a no-op from Redis 7.0 on).
redis.replicate_commands()

local now = tonumber(ARGV[2])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local op, id = ARGV[1], ARGV[3]
local limit, ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
-- The set lives until its last slot expires (and a second more): holders with a longer ttl
-- (another build during a rolling change, another service on the same name) keep theirs.
local function keep()
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(last[2]) - now) / 1000) + 1000)
end
if op == 'acquire' then
  if held >= limit then return { 0, held } end
  redis.call('ZADD', KEYS[1], now + ttl, id)
  keep()
  return { 1, held + 1 }
elseif op == 'renew' then
  -- A slot the server lost (a restart, a failover, an outage past its ttl) is held again,
  -- over the limit if need be: its request is still in flight, and the count must say so.
  local kept = redis.call('ZSCORE', KEYS[1], id) and 1 or 0
  redis.call('ZADD', KEYS[1], now + ttl, id)
  keep()
  return { kept, held + 1 - kept }
elseif op == 'release' then
  local removed = redis.call('ZREM', KEYS[1], id)
  return { removed, held - removed }
end
return redis.error_reply('fleetlimit: unknown slots operation ' .. tostring(op))
