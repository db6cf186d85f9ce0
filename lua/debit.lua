-- Debits: another region admitted amount tokens under a rule, the last of
-- them at the instant at (µs, the source's clock with the reconciler's
-- clock allowance added; at most now); spend them here too, without a
-- decision, as of that instant. Every spend is kept, up to a debt bound that
-- one reconcile lag of remote traffic does not reach (DEBT_HORIZON_US, 10 s:
-- bucket.DebtHorizon), so the regions together admit at most capacity +
-- rate * T plus about one interval of remote spending, and a burst of
-- remote traffic (or a corrupt message) cannot block a key for long:
--   token_bucket, gcra: the state moves to the spend of amount after the
--     later of the instant it is full again and at, at most to capacity +
--     rate * 10 s of debt, refilling at the usual rate; checks read the
--     state with the same bound, so the debt is kept. An absent key counts
--     as full since KEEP_FULL_NS ago (its key outlives a full bucket that
--     long), so a spend that refilled before it arrived writes nothing;
--   sliding_window, fixed_window: amount joins the current window's count,
--     at most limit + max(limit, limit * 10 s / window), unless at fell in
--     a window that no longer counts (before the previous one for a sliding
--     window, before the current one for a fixed window);
--   sliding_log: amount entries join the log at now, up to the same bound
--     with at most 1000 entries beyond the limit, unless at is out of the
--     window.
-- An amount that is not above 0 spends nothing. Each returns the overshoot
-- it finds: by how much the admissions this region knows of, its own and
-- the others', exceed the limit right after the debit (the debt; 0 when the
-- bucket had room), and whether it wrote anything; a token bucket's,
-- GCRA's or window's also how far it left the key from full, and full, in
-- the same unit (ns of refill; tokens), for its hold (hold_record.lua). Mirrors Limit.DebitAt
-- in pkg/bucket.

local function overshoot(amount, room)
  return math.max(amount - room, 0)
end

-- The instant (ns from now) a debit as of at starts from in a bucket whose
-- state is v (nil: absent): the later of the instant it is full again,
-- bounded (an absent key full since bucket_keep ago, a debt at most most
-- ahead), and at.
local function debit_start(v, full, most, now, at)
  local keep = bucket_keep(full)
  local start = -keep
  if v then start = bucket_ahead(v, now) or 0 end
  if start < -keep then start = -keep end
  if start > most then start = most end
  local a = (at - now) * 1000
  if a > 0 then a = 0 end
  if start < a then start = a end
  return start
end

-- The bucket's state as the caller read it (v: a string, or false for an
-- absent key), or read now (v nil).
local function debit_state(key, v)
  if v == nil then return read_string(key) end
  return v or nil
end

-- Whether a spend of amount (above 0) admitted at at, debited at now, would
-- write nothing: it refilled before it arrived. v as for debit_state. The
-- window algorithms read nothing.
local function debit_refilled(alg, key, cap, rw, amount, now, at, v)
  if alg == 'token_bucket' or alg == 'gcra' then
    local full = spend_ns(cap, rw)
    return debit_start(debit_state(key, v), full, 2 * full + DEBT_HORIZON_US * 1000, now, at) + spend_ns(amount, rw) <= 0
  elseif alg == 'sliding_window' then
    return window_index(at, rw) < window_index(now, rw) - 1
  elseif alg == 'fixed_window' then
    return window_index(at, rw) < window_index(now, rw)
  elseif alg == 'sliding_log' then
    return at <= now - rw
  end
  return false
end

local function debit_instant(key, cap, rate, amount, now, at, tag, v)
  if not (amount and amount > 0) then return 0, false end
  local full = spend_ns(cap, rate)
  local most = 2 * full + DEBT_HORIZON_US * 1000
  local start = debit_start(debit_state(key, v), full, most, now, at)
  local over = overshoot(amount, cap - start * rate / 1e9)
  local d = start + spend_ns(amount, rate)
  if d <= 0 then return over, false end
  d = math.min(d, most)
  bucket_write(key, now, d, full)
  return over, true, d, full
end

local function debit_sliding_window(key, cap, w, amount, now, at)
  if not (amount and amount > 0) then return 0, false end
  if debit_refilled('sliding_window', key, cap, w, amount, now, at) then return 0, false end
  local cur, prev, idx
  cur, prev, idx, now = sliding_window_at(key, w, now)
  local f = (now - idx * w) / w
  local over = overshoot(amount, micro(cap) - (prev * (1 - f) + cur))
  local n = math.min(micro(cur + amount), window_most(cap, w))
  sliding_window_write(key, idx, w, n, prev, now)
  return over, true, prev * (1 - f) + n, cap
end

local function debit_fixed_window(key, cap, w, amount, now, at)
  if not (amount and amount > 0) then return 0, false end
  if debit_refilled('fixed_window', key, cap, w, amount, now, at) then return 0, false end
  local count, fresh, idx = fixed_window_at(key, w, now)
  local over = overshoot(amount, micro(cap) - count)
  local n = math.min(micro(count + amount), window_most(cap, w))
  fixed_window_write(key, idx, w, n, fresh)
  return over, true, n, cap
end

local function debit_sliding_log(key, cap, w, amount, now, at, tag)
  if not (amount and amount > 0) then return 0, false end
  if debit_refilled('sliding_log', key, cap, w, amount, now, at) then return 0, false end
  local n = sliding_log_trim(key, w, now)
  local over = overshoot(amount, cap - n)
  local most = cap + math.min(math.max(cap, math.floor(cap * DEBT_HORIZON_US / w)), 1000)
  local k = math.min(math.floor(amount + 0.5), most - n)
  if k < 1 then return over, true end
  local args = {}
  local score = fmt_int(now)
  for i = 1, k do
    args[#args + 1] = score
    args[#args + 1] = string.format('%d.d%s.%d', now, tag, i)
  end
  redis.call('ZADD', key, unpack(args))
  redis.call('PEXPIRE', key, fmt_int(math.ceil(w / 1000) + EXPIRY_PAD_MS))
  return over, true
end

local debits = {
  token_bucket = debit_instant,
  gcra = debit_instant,
  sliding_window = debit_sliding_window,
  fixed_window = debit_fixed_window,
  sliding_log = debit_sliding_log,
}
