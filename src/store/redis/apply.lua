-- fleetlimit: apply one operation to a batch of checks, atomically.
--
-- KEYS[i]: the state of check i (all keys of one call share a hash tag or a slot).
-- ARGV[1]: 'consume' | 'peek' | 'refund' | 'lease' | 'release'
-- ARGV[2]: now in µs since the epoch, or '' to read the server's clock (the fleet's one clock).
-- ARGV[3 + 8(i-1) ...]: for check i: algorithm (1 fixed window, 2 sliding log, 3 sliding
--   window, 4 token bucket, 5 gcra), limit, period (µs), burst, emission interval (µs),
--   token units, refill units, cost.
-- For 'lease' (one check; its cost is the most permits wanted), ARGV[11] is the longest
-- validity (µs); for 'release' (its cost is the unspent permits), ARGV[11] is the lease's
-- valid-until (µs).
-- Returns 5 integers per check: allowed (1/0), limit, remaining, reset after (µs), retry after
-- (µs, -1 when none); for 'lease' and 'release', then the permits granted, until when they are
-- valid, and for how long from now.
local ALGORITHMS = { fixed_window, sliding_log, sliding_window, token_bucket, gcra }

local op = ARGV[1]
local now = tonumber(ARGV[2])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local checks = {}
for i = 1, #KEYS do
  local a = 3 + 8 * (i - 1)
  local q = {
    limit = tonumber(ARGV[a + 1]), period = tonumber(ARGV[a + 2]), burst = tonumber(ARGV[a + 3]),
    emission = tonumber(ARGV[a + 4]), token_units = tonumber(ARGV[a + 5]),
    refill_units = tonumber(ARGV[a + 6]),
  }
  local alg = ALGORITHMS[tonumber(ARGV[a])]
  if alg == nil then return redis.error_reply('fleetlimit: unknown algorithm ' .. tostring(ARGV[a])) end
  checks[i] = { alg = alg, q = q, cost = tonumber(ARGV[a + 7]), st = alg.load(KEYS[i], q) }
end

local out = {}
local function emit(d)
  for j = 1, 5 do out[#out + 1] = d[j] end
end

if op == 'lease' or op == 'release' then
  local c = checks[1]
  local extra = tonumber(ARGV[3 + 8 * #KEYS])
  local granted, valid_until = 0, 0
  c.alg.decide(c.st, now, c.q, 1)
  if op == 'lease' then
    if c.alg.lease == nil then return redis.error_reply('fleetlimit: this algorithm cannot be leased') end
    granted, valid_until = c.alg.lease(c.st, now, c.q, c.cost, extra)
  elseif now < extra then
    c.alg.refund(c.st, now, c.q, c.cost)
  end
  c.alg.save(c.st, now, c.q)
  local d = c.alg.decide(c.st, now, c.q, 1)
  if d[1] == 1 then d[3] = d[3] + 1 end
  emit(d)
  out[#out + 1] = granted
  out[#out + 1] = valid_until
  out[#out + 1] = math.max(valid_until - now, 0)
  return out
end

if op == 'refund' then
  for _, c in ipairs(checks) do
    c.alg.decide(c.st, now, c.q, 1)
    c.alg.refund(c.st, now, c.q, c.cost)
    c.alg.save(c.st, now, c.q)
    local d = c.alg.decide(c.st, now, c.q, 1)
    if d[1] == 1 then d[3] = d[3] + 1 end
    emit(d)
  end
  return out
end

local decisions = {}
local all_allowed = true
for i, c in ipairs(checks) do
  decisions[i] = c.alg.decide(c.st, now, c.q, c.cost)
  if decisions[i][1] == 0 then all_allowed = false end
end

for i, c in ipairs(checks) do
  local d = decisions[i]
  if op == 'consume' and all_allowed then
    c.alg.commit(c.st, now, c.q, c.cost)
    c.alg.save(c.st, now, c.q)
  elseif d[1] == 1 then
    -- Nothing is taken: report the permits as still there.
    d[3] = d[3] + c.cost
  end
  emit(d)
end
return out
