-- Fixed window: src/algorithm/fixed_window.rs, line for line.
-- State: HASH { s = start, c = count, p = the period the window was aligned to, v = receipts
-- from before this time refund nothing, h = the count a longer window holds until u }.
local fixed_window = {}

function fixed_window.load(key)
  local v = hash_numbers(key, { 's', 'c', 'p', 'v', 'h', 'u' })
  return {
    key = key, start = v[1] or 0, count = v[2] or 0, period = v[3] or 0, valid_from = v[4] or 0,
    held = v[5] or 0, held_until = v[6] or 0,
  }
end

function fixed_window.decide(st, now, q, cost)
  local period, limit = q.period, q.limit
  local window = now - (now % period)
  if st.held_until <= now then
    st.held = 0
    st.held_until = 0
  end
  if st.period ~= period then
    -- A conversion is not a roll forward: it must be kept even by a peek or a denial.
    if st.period ~= 0 then
      st.dirty = true
      st.valid_from = now
    end
    local old_end = st.start + st.period
    local window_end = window + period
    -- The new window counts what the old one still counts and what a held count holds.
    local still = 0
    if now < old_end then still = st.count end
    local count = math.max(still, st.held)
    -- Counts whose windows outlast this one are held until they end.
    if st.held_until <= window_end then
      st.held = 0
      st.held_until = 0
    end
    if still > 0 and old_end > window_end then
      st.held = math.max(st.held, still)
      st.held_until = math.max(st.held_until, old_end)
    end
    st.count = count
    st.start = window
    st.period = period
  end
  if window > st.start then
    st.start = window
    st.count = 0
  end
  local to_end = math.max(st.start + period - now, 0)
  local remaining = math.max(limit - st.count, 0)
  local reset_after = to_end
  if st.count == 0 then reset_after = 0 end
  if cost > limit then return { 0, limit, remaining, reset_after, -1 } end
  if st.count + cost <= limit then
    return { 1, limit, remaining - cost, to_end, -1 }
  end
  return { 0, limit, remaining, reset_after, to_end }
end

function fixed_window.taken(st, now, cost)
  local at = math.max(now, st.start)
  if st.valid_from == 0 and cost > 0 then st.valid_from = at end
  return at
end

-- Count n permits taken at now: in this window, and in a longer one that holds a count.
local function fw_count_now(st, now, n)
  st.count = st.count + n
  -- Up to 2^52: above every limit, and exact.
  if st.held_until > now then st.held = math.min(st.held + n, 4503599627370496) end
end

function fixed_window.commit(st, now, q, cost)
  fw_count_now(st, now, cost)
  return fixed_window.taken(st, now, cost)
end

function fixed_window.refund(st, now, q, at, cost)
  if at < st.valid_from or st.period == 0 then return end
  if at - (at % st.period) == st.start then st.count = math.max(st.count - cost, 0) end
end

function fixed_window.save(st, now, q)
  local expires_at = 0
  if st.count > 0 then expires_at = st.start + st.period end
  if st.held > 0 then expires_at = math.max(expires_at, st.held_until) end
  if expires_at > now then
    redis.call('HSET', st.key, 's', int(st.start), 'c', int(st.count), 'p', int(st.period),
      'v', int(st.valid_from), 'h', int(st.held), 'u', int(st.held_until))
  end
  expire_at(st.key, expires_at, now)
end

function fixed_window.lease(st, now, q, max, max_validity)
  local permits = math.min(max, math.max(q.limit - st.count, 0))
  fw_count_now(st, now, permits)
  return permits, math.min(now + max_validity, st.start + q.period), fixed_window.taken(st, now, permits)
end
