-- Sliding window counter: src/algorithm/sliding_window.rs, line for line.
-- State: HASH { s = start of the current sub-window, b = the counts, oldest first, as a
-- MessagePack array of integers (the sub-window sliding out, then the n the period spans),
-- w = the period the sub-windows were aligned to, v = receipts from before this time refund
-- nothing, h = the count a longer alignment holds until u (both only while one does) }.
local sliding_window = {}

function sliding_window.load(key)
  local v = redis.call('HMGET', key, 's', 'b', 'w', 'v', 'p', 'c', 'h', 'u')
  local counts, legacy = {}, false
  if v[2] then
    counts = cmsgpack.unpack(v[2])
  elseif v[6] then
    -- Written by the two-counter layout of earlier builds: previous and current window.
    counts = { tonumber(v[5]) or 0, tonumber(v[6]) or 0 }
    legacy = true
  end
  return {
    key = key, start = tonumber(v[1]) or 0, counts = counts, period = tonumber(v[3]) or 0,
    valid_from = tonumber(v[4]) or 0, legacy = legacy,
    held = tonumber(v[7]) or 0, held_until = tonumber(v[8]) or 0, had_held = v[7] ~= false,
  }
end

local function sw_width(st)
  if #st.counts < 2 then return 0 end
  return st.period / (#st.counts - 1)
end

local function sw_still_counted(st, now)
  local width, len = sw_width(st), #st.counts
  local sum = 0
  for i = 1, len do
    local from = math.max(st.start - (len - i) * width, 0)
    if now < from + st.period + width then sum = sum + st.counts[i] end
  end
  return sum
end

local function sw_empty_from(st, now)
  local width, len = sw_width(st), #st.counts
  for i = len, 1, -1 do
    if st.counts[i] > 0 then return st.start - (len - i) * width + st.period + width end
  end
  return now
end

local function sw_roll(st, now, q)
  local period, n = q.period, q.sub_windows
  local width = period / n
  local window = now - (now % width)
  -- A hold that has ended is dropped here, so that its fields go (the memory store keeps it
  -- until its next conversion: no decision differs, an ended hold counts nothing).
  if st.held_until <= now then
    st.held = 0
    st.held_until = 0
  end
  if st.period ~= period or #st.counts ~= n + 1 then
    -- A conversion is not a roll forward: it must be kept even by a peek or a denial.
    local valid_from = st.valid_from
    if st.period ~= 0 then
      st.dirty = true
      valid_from = now
    end
    local still = sw_still_counted(st, now)
    -- The new alignment counts what the old one still counts and what a held count holds.
    local count = math.max(still, st.held)
    local held, held_until = st.held, st.held_until
    local released = window + period + width
    if held_until <= released then
      held = 0
      held_until = 0
    end
    -- When the old alignment lets its last permit go: from its newest non-empty sub-window.
    local old_released = sw_empty_from(st, now)
    if still > 0 and old_released > released then
      held = math.max(held, still)
      held_until = math.max(held_until, old_released)
    end
    local counts = {}
    for i = 1, n + 1 do counts[i] = 0 end
    counts[n + 1] = count
    st.start, st.counts, st.period, st.valid_from = window, counts, period, valid_from
    st.held, st.held_until = held, held_until
  end
  if window > st.start then
    local steps = (window - st.start) / width
    local len = #st.counts
    for i = 1, len do
      if i + steps <= len then
        st.counts[i] = st.counts[i + steps]
      else
        st.counts[i] = 0
      end
    end
    st.start = window
  end
end

local function sw_weighted(st, now, q, w_ms)
  local elapsed_ms = 0
  if not q.bounded then
    elapsed_ms = math.min(math.floor(math.max(now - st.start, 0) / 1000), w_ms)
  end
  local newer = 0
  for i = 2, #st.counts do newer = newer + st.counts[i] end
  return st.counts[1] * (w_ms - elapsed_ms) + newer * w_ms
end


local function sw_retry_at(st, q, cost)
  local width = q.period / q.sub_windows
  local w_ms = width / 1000
  local limit = q.limit
  local len = #st.counts
  local newer = 0
  for i = 1, len do newer = newer + st.counts[i] end
  for ahead = 0, len - 1 do
    local oldest = st.counts[ahead + 1]
    newer = newer - oldest
    if newer + cost <= limit then
      local room = (limit - newer - cost) * w_ms
      local e = 0
      if oldest > 0 then
        if not q.bounded then
          e = w_ms - math.min(math.floor(room / oldest), w_ms)
        elseif oldest * w_ms > room then
          e = w_ms
        end
      end
      if e < w_ms then return st.start + ahead * width + e * 1000 end
    end
  end
  return st.start + len * width
end

function sliding_window.decide(st, now, q, cost)
  sw_roll(st, now, q)
  local period, limit = q.period, q.limit
  local width = period / q.sub_windows
  local w_ms = width / 1000
  local weighted = sw_weighted(st, now, q, w_ms)
  local capacity = limit * w_ms
  local remaining = math.floor(math.max(capacity - weighted, 0) / w_ms)
  local reset_after = math.max(sw_empty_from(st, now) - now, 0)
  if cost > limit then return { 0, limit, remaining, reset_after, -1 } end
  if weighted + cost * w_ms <= capacity then
    return { 1, limit, remaining - cost, math.max(st.start + period + width - now, 0), -1 }
  end
  return { 0, limit, remaining, reset_after, math.max(sw_retry_at(st, q, cost) - now, 0) }
end

function sliding_window.taken(st, now, cost)
  local at = math.max(now, st.start)
  if st.valid_from == 0 and cost > 0 then st.valid_from = at end
  return at
end

-- Count n more permits at now: in the current sub-window, and in a longer alignment that holds
-- a count (up to 2^52: above every limit, and exact).
local function sw_count_now(st, now, n)
  local len = #st.counts
  st.counts[len] = st.counts[len] + n
  if st.held_until > now then st.held = math.min(st.held + n, 4503599627370496) end
end

function sliding_window.commit(st, now, q, cost)
  sw_count_now(st, now, cost)
  return sliding_window.taken(st, now, cost)
end

function sliding_window.refund(st, now, q, at, cost)
  local width = sw_width(st)
  if at < st.valid_from or width == 0 then return end
  local window = at - (at % width)
  if window > st.start then return end
  local back = (st.start - window) / width
  local len = #st.counts
  if back < len then
    local i = len - back
    st.counts[i] = math.max(st.counts[i] - cost, 0)
  end
end

function sliding_window.save(st, now, q)
  local expires_at = 0
  for i = 1, #st.counts do
    if st.counts[i] > 0 then
      expires_at = sw_empty_from(st, now)
      break
    end
  end
  if st.held > 0 then expires_at = math.max(expires_at, st.held_until) end
  if expires_at > now then
    redis.call('HSET', st.key, 's', int(st.start), 'b', cmsgpack.pack(st.counts),
      'w', int(st.period), 'v', int(st.valid_from))
    if st.held > 0 then
      redis.call('HSET', st.key, 'h', int(st.held), 'u', int(st.held_until))
    elseif st.had_held then
      redis.call('HDEL', st.key, 'h', 'u')
    end
    if st.legacy then redis.call('HDEL', st.key, 'p', 'c') end
  end
  expire_at(st.key, expires_at, now)
end

function sliding_window.lease(st, now, q, max, max_validity)
  local width = q.period / q.sub_windows
  local w_ms = width / 1000
  local room = math.floor(math.max(q.limit * w_ms - sw_weighted(st, now, q, w_ms), 0) / w_ms)
  local permits = math.min(max, room)
  sw_count_now(st, now, permits)
  return permits, math.min(now + max_validity, st.start + width), sliding_window.taken(st, now, permits)
end
