-- GCRA: src/algorithm/gcra.rs, line for line.
-- State: HASH { t = theoretical arrival time (µs), e = the emission interval it was written under,
-- v = receipts from before this time refund nothing, l = the latest time it was decided at }.
local gcra = {}

function gcra.load(key)
  local v = hash_numbers(key, { 't', 'e', 'v', 'l' })
  return {
    key = key, tat = v[1] or 0, emission = v[2] or 0, valid_from = v[3] or 0, latest = v[4] or 0,
  }
end

function gcra.decide(st, now, q, cost)
  local t, burst = q.emission, q.burst
  local horizon = burst * t
  if st.emission ~= t then
    if st.emission ~= 0 then
      if st.tat > now then
        -- A conversion is not a roll forward: it must be kept even by a peek or a denial.
        st.dirty = true
        local lead = rescale_ceil(st.tat - now, st.emission, t)
        -- Cut at the cap: refused under this quota, and kept in its own scale (see apply.lua).
        st.clamped = lead >= RESCALE_CAP
        st.tat = now + lead
      end
      st.valid_from = now
    end
    st.emission = t
  end
  st.latest = math.max(st.latest, now)
  local tat = math.max(st.tat, now)
  local ahead = tat - now
  local remaining = math.floor(math.max(horizon - ahead, 0) / t)
  if cost > burst then return { 0, burst, remaining, ahead, -1 } end
  local new_ahead = ahead + cost * t
  if new_ahead <= horizon then
    return { 1, burst, math.floor((horizon - new_ahead) / t), new_ahead, -1 }
  end
  return { 0, burst, remaining, ahead, new_ahead - horizon }
end

function gcra.taken(st, now, cost)
  if st.valid_from == 0 and cost > 0 then st.valid_from = now end
  return now
end

function gcra.commit(st, now, q, cost)
  st.tat = math.max(st.tat, now) + cost * q.emission
  return gcra.taken(st, now, cost)
end

function gcra.refund(st, now, q, at, cost)
  if at < st.valid_from then return end
  local debt = math.min(cost, q.burst) * q.emission
  local elapsed = math.max(math.max(now, st.latest) - at, 0)
  if elapsed >= debt then return end
  st.tat = math.max(st.tat - (debt - elapsed), now)
end

function gcra.save(st, now, q)
  if st.tat > now then
    redis.call('HSET', st.key, 't', int(st.tat), 'e', int(st.emission), 'v', int(st.valid_from),
      'l', int(st.latest))
  end
  expire_at(st.key, st.tat, now)
end

function gcra.lease(st, now, q, max, max_validity)
  local t = q.emission
  local horizon = q.burst * t
  local tat = math.max(st.tat, now)
  local permits = math.min(max, math.floor(math.max(horizon - (tat - now), 0) / t))
  st.tat = tat + permits * t
  return permits, now + max_validity, gcra.taken(st, now, permits)
end
