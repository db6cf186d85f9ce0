-- Debits: another region admitted amount tokens under a rule; spend them
-- here too, without a decision. Every spend is kept, up to a debt bound that
-- one reconcile lag of remote traffic does not reach (DEBT_HORIZON_US, 10 s:
-- bucket.DebtHorizon), so the regions together admit at most capacity +
-- rate * T plus about one interval of remote spending, and a burst of
-- remote traffic (or a corrupt message) cannot block a key for long:
--   token_bucket, gcra: the state moves by the spend of amount, at most to
--     capacity + rate * 10 s of debt, refilling at the usual rate; checks
--     read the state with the same bound, so the debt is kept;
--   sliding_window, fixed_window: amount joins the current window's count,
--     at most limit + max(limit, limit * 10 s / window);
--   sliding_log: amount entries join the log at now, up to the same bound
--     with at most 1000 entries beyond the limit.
-- An amount that is not above 0 spends nothing. Each returns the overshoot
-- it finds: by how much the admissions this region knows of, its own and
-- the others', exceed the limit right after the debit (the debt; 0 when the
-- bucket had room). Mirrors Limit.Debit in pkg/bucket.

local function overshoot(amount, room)
  return math.max(amount - room, 0)
end

local function debit_instant(key, cap, rate, amount, now)
  if not (amount and amount > 0) then return 0 end
  local d, full = bucket_debt(key, cap, rate, now)
  local over = overshoot(amount, cap - d * rate / 1e9)
  bucket_write(key, now, math.min(d + spend_ns(amount, rate), 2 * full + DEBT_HORIZON_US * 1000))
  return over
end

local function debit_sliding_window(key, cap, w, amount, now)
  if not (amount and amount > 0) then return 0 end
  local cur, prev, idx
  cur, prev, idx, now = sliding_window_at(key, w, now)
  local f = (now - idx * w) / w
  local over = overshoot(amount, micro(cap) - (prev * (1 - f) + cur))
  sliding_window_write(key, idx, w, math.min(micro(cur + amount), window_most(cap, w)), prev, now)
  return over
end

local function debit_fixed_window(key, cap, w, amount, now)
  if not (amount and amount > 0) then return 0 end
  local count, fresh, idx = fixed_window_at(key, w, now)
  local over = overshoot(amount, micro(cap) - count)
  fixed_window_write(key, idx, w, math.min(micro(count + amount), window_most(cap, w)), fresh)
  return over
end

local function debit_sliding_log(key, cap, w, amount, now, tag)
  if not (amount and amount > 0) then return 0 end
  local n = sliding_log_trim(key, w, now)
  local over = overshoot(amount, cap - n)
  local most = cap + math.min(math.max(cap, math.floor(cap * DEBT_HORIZON_US / w)), 1000)
  local k = math.min(math.floor(amount + 0.5), most - n)
  if k < 1 then return over end
  local args = {}
  local score = fmt_int(now)
  for i = 1, k do
    args[#args + 1] = score
    args[#args + 1] = string.format('%d.d%s.%d', now, tag, i)
  end
  redis.call('ZADD', key, unpack(args))
  redis.call('PEXPIRE', key, fmt_int(math.ceil(w / 1000) + EXPIRY_PAD_MS))
  return over
end

local debits = {
  token_bucket = debit_instant,
  gcra = debit_instant,
  sliding_window = debit_sliding_window,
  fixed_window = debit_fixed_window,
  sliding_log = debit_sliding_log,
}
