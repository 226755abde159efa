-- fleetlimit: apply one operation to a batch of checks, atomically.
--
-- KEYS[i]: the state of check i (all keys of one call share a hash tag or a slot); for
--   'consume', 'peek' and 'lease', optionally followed by KEYS[n + i]: the listing of check i's
--   key ('allow', 'deny', or the end of a block in µs; see listing.lua), which outranks quotas.
-- ARGV[1]: 'consume' | 'peek' | 'refund' | 'lease'
-- ARGV[2]: now in µs since the epoch, or '' to read the server's clock (the fleet's one clock).
-- ARGV[3 + 11(i-1) ...]: for check i: algorithm (1 fixed window, 2 sliding log, 3 sliding
--   window, 4 token bucket, 5 gcra), limit, period (µs), burst, emission interval (µs),
--   token units, refill units, sub-windows, bounded (1: the sliding window counter counts the
--   sub-window sliding out whole), cost, and for 'refund' the receipt's anchor (µs; else '').
-- For 'lease' (one check; its cost is the most permits wanted), the argument after the checks
-- is the longest validity (µs).
-- For 'refund', the last key (after the checks' keys, in their slot) is the call's once key: a
-- refund sent again (a client resends a call after its connection broke, not knowing whether it
-- ran) answers what the first answered and gives nothing back twice. A refund sent again after
-- an answer that says it did not run (TRYAGAIN on a migrating slot) comes without it.
-- Returns 6 integers per check: allowed (1/0), limit, remaining, reset after (µs), retry after
-- (µs, -1 when none), and where the permits were taken (the receipt's anchor, -1 when nothing
-- was taken; -2 or below when the key's listing decided: see listed_anchor); for 'lease', then
-- the permits granted, until when they are valid, for how long
-- from now, the block's anchor, and whether the key is listed (1/0: then nothing is granted
-- and the decision is the listing's, for each request).
local ALGORITHMS = { fixed_window, sliding_log, sliding_window, token_bucket, gcra }
local PER_CHECK = 11
-- Longer than any resend can come after the first send (retries are immediate or follow a
-- reconnection, both well within a decision's deadline).
local ONCE_TTL_MS = 10000

local op = ARGV[1]
local nchecks = math.floor((#ARGV - 2) / PER_CHECK)
local once = nil
local with_listings = op ~= 'refund' and #KEYS >= 2 * nchecks
-- A deny-list entry has no end: its clients are told to come back in a day.
local DENY_WAIT_US = 86400000000
if op == 'refund' then
  once = KEYS[nchecks + 1]
  local answered = once and redis.call('GET', once)
  if answered then
    local replay = {}
    for v in string.gmatch(answered, '[^,]+') do replay[#replay + 1] = tonumber(v) end
    return replay
  end
end
local now = tonumber(ARGV[2])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local checks = {}
-- Checks on one key (refunds of several receipts) share one state.
local states = {}
for i = 1, nchecks do
  local a = 3 + PER_CHECK * (i - 1)
  local q = {
    limit = tonumber(ARGV[a + 1]), period = tonumber(ARGV[a + 2]), burst = tonumber(ARGV[a + 3]),
    emission = tonumber(ARGV[a + 4]), token_units = tonumber(ARGV[a + 5]),
    refill_units = tonumber(ARGV[a + 6]), sub_windows = tonumber(ARGV[a + 7]),
    bounded = ARGV[a + 8] == '1',
  }
  local alg = ALGORITHMS[tonumber(ARGV[a])]
  if alg == nil then return redis.error_reply('fleetlimit: unknown algorithm ' .. tostring(ARGV[a])) end
  local st = states[KEYS[i]]
  if st == nil then
    st = alg.load(KEYS[i], q)
    states[KEYS[i]] = st
  end
  checks[i] = { alg = alg, q = q, cost = tonumber(ARGV[a + 9]), at = tonumber(ARGV[a + 10]), st = st }
end

-- Check i's listing in force: 'allow', 'deny', a block's end (µs), or nil.
local function listed(i)
  if not with_listings then return nil end
  local v = redis.call('GET', KEYS[nchecks + i])
  if not v or v == 'allow' or v == 'deny' then return v or nil end
  local t = tonumber(v)
  if t ~= nil and t > now then return t end
  return nil
end

local listing = {}
for i = 1, nchecks do listing[i] = listed(i) end

-- The anchor of a decision made by listing `l` (nothing taken): -2 the allow list, -3 the deny
-- list, -(4 + µs left) a block.
local function listed_anchor(l)
  if l == 'allow' then return -2 end
  if l == 'deny' then return -3 end
  return -(4 + math.max(l - now, 0))
end

-- Refused for at least `wait` (a rule's own longer wait stands).
local function refuse(d, wait)
  d[1] = 0
  d[3] = 0
  if d[5] < wait then d[5] = wait end
  if d[4] < wait then d[4] = wait end
  return d
end

local out = {}
local function emit(d, taken)
  for j = 1, 5 do out[#out + 1] = d[j] end
  out[#out + 1] = taken
end

-- The state as a request of cost 1 would see it, taking nothing.
local function peek(c)
  local d = c.alg.decide(c.st, now, c.q, 1)
  if d[1] == 1 then d[3] = d[3] + 1 end
  return d
end

-- A listed check decides by its listing, from its state as a peek sees it, taking nothing.
local function decide_listed(c, l)
  local d = peek(c)
  if l == 'allow' then
    d[1] = 1
  elseif l == 'deny' then
    refuse(d, DENY_WAIT_US)
  else
    refuse(d, l - now)
  end
  return d
end

if op == 'lease' and listing[1] ~= nil then
  -- A listed key is decided request by request: no block. As a peek, it writes nothing.
  local c = checks[1]
  c.st.readonly = true
  emit(decide_listed(c, listing[1]), listed_anchor(listing[1]))
  out[#out + 1] = 0
  out[#out + 1] = now
  out[#out + 1] = 0
  out[#out + 1] = now
  out[#out + 1] = 1
  return out
end

if op == 'lease' then
  local c = checks[1]
  local max_validity = tonumber(ARGV[3 + PER_CHECK * nchecks])
  if c.alg.lease == nil then return redis.error_reply('fleetlimit: this algorithm cannot be leased') end
  c.alg.decide(c.st, now, c.q, 1)
  local granted, valid_until, at = 0, now, now
  -- A debt cut at the conversion's cap: nothing to lease, and the state kept in its own scale.
  if not c.st.clamped then
    granted, valid_until, at = c.alg.lease(c.st, now, c.q, c.cost, max_validity)
    c.alg.save(c.st, now, c.q)
  end
  emit(peek(c), -1)
  out[#out + 1] = granted
  out[#out + 1] = valid_until
  out[#out + 1] = math.max(valid_until - now, 0)
  out[#out + 1] = at
  out[#out + 1] = 0
  return out
end

if op == 'refund' then
  for _, c in ipairs(checks) do
    c.st.readonly = true
    c.alg.decide(c.st, now, c.q, 1)
    -- A receipt of another algorithm comes with cost 0: it refunds nothing. Nor does one for a
    -- state written under another quota: a refund never converts a state (the memory store's
    -- refund_now says why), so nothing is saved.
    if not c.st.dirty then
      if c.cost > 0 then c.alg.refund(c.st, now, c.q, c.at, c.cost) end
      c.alg.save(c.st, now, c.q)
    end
    emit(peek(c), -1)
  end
  local answer = {}
  for j, v in ipairs(out) do answer[j] = string.format('%d', v) end
  if once then redis.call('SET', once, table.concat(answer, ','), 'PX', ONCE_TTL_MS) end
  return out
end

-- A request a listing refuses takes nothing, and its other checks are only peeked (as the
-- memory store's around_known does): like every peek, they write nothing.
local peeking = op ~= 'consume'
for i = 1, nchecks do
  if listing[i] ~= nil and listing[i] ~= 'allow' then peeking = true end
end
-- What only reads a state writes nothing to it (a sliding log forgets no entry): a peek, a
-- listed check (decided as a peek sees it), the checks of a request a listing refuses.
for i, c in ipairs(checks) do
  if peeking or listing[i] ~= nil then c.st.readonly = true end
end

local decisions = {}
local all_allowed = true
for i, c in ipairs(checks) do
  if listing[i] ~= nil then
    decisions[i] = decide_listed(c, listing[i])
  else
    decisions[i] = c.alg.decide(c.st, now, c.q, c.cost)
  end
  if decisions[i][1] == 0 then all_allowed = false end
end

for i, c in ipairs(checks) do
  local d = decisions[i]
  local taken = -1
  if listing[i] ~= nil then
    -- Counted nothing, and decided from the state as a peek sees it: written nothing.
    taken = listed_anchor(listing[i])
  elseif op == 'consume' and all_allowed then
    taken = c.alg.commit(c.st, now, c.q, c.cost)
    c.alg.save(c.st, now, c.q)
  else
    if d[1] == 1 then
      -- Nothing is taken: report the permits as still there.
      d[3] = d[3] + c.cost
    end
    -- A consume's state read under another quota keeps its conversion (the memory store's
    -- does too); a peek writes nothing: it may read a key under a quota not its own. A
    -- conversion that cut a debt at the cap is not kept either: under the quota that cut it the
    -- key is refused anyway, and read back under its own, the cut debt would be gone.
    if c.st.dirty and not c.st.clamped and not peeking then c.alg.save(c.st, now, c.q) end
  end
  emit(d, taken)
end
return out
