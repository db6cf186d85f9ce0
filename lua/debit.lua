-- Debits: another region admitted amount tokens under a rule; spend them
-- here too, without a decision. Each algorithm bounds the debt, so a burst of
-- remote traffic (or a corrupt message) cannot block a key for long:
--   token_bucket, gcra: the state moves by amount / rate, at most to one
--     capacity of debt (tokens >= -capacity), refilling at the usual rate;
--     checks read the state with the same bound, so the debt is kept;
--   sliding_window, fixed_window: amount joins the current window's count,
--     at most twice the limit;
--   sliding_log: amount entries join the log at now, up to the limit.
-- Each returns the overshoot it finds: by how much the admissions this
-- region knows of, its own and the others', exceed the limit right after
-- the debit (the debt; 0 when the bucket had room).

local function overshoot(amount, room)
  return math.max(amount - room, 0)
end

local function debit_token_bucket(key, cap, rate, amount, now)
  local full = token_bucket_full(key, cap, rate, now)
  local over = overshoot(amount, cap - (full - now) * rate / 1e6)
  full = math.min(full + round_us(amount * 1e6 / rate), now + round_us(2 * cap * 1e6 / rate))
  redis.call('SET', key, fmt_int(full), 'PX', fmt_int(math.ceil((full - now) / 1000)))
  return over
end

local function debit_gcra(key, cap, rate, amount, now)
  local tolerance = round_us(cap * 1e6 / rate)
  local tat = gcra_tat(key, cap, rate, now)
  local over = overshoot(amount, (tolerance - (tat - now)) * rate / 1e6)
  tat = math.min(tat + round_us(amount * 1e6 / rate), now + 2 * tolerance)
  redis.call('SET', key, fmt_int(tat), 'PX', fmt_int(math.ceil((tat - now) / 1000)))
  return over
end

local function debit_sliding_window(key, cap, w, amount, now)
  local idx = window_index(now, w)
  local cur, prev = sliding_window_read(key, idx)
  local f = (now - idx * w) / w
  local over = overshoot(amount, cap - (prev * (1 - f) + cur))
  sliding_window_write(key, idx, w, math.min(cur + amount, 2 * cap), prev, now)
  return over
end

local function debit_fixed_window(key, cap, w, amount, now)
  local idx = window_index(now, w)
  local count, fresh = fixed_window_read(key, idx)
  local over = overshoot(amount, cap - count)
  fixed_window_write(key, idx, w, math.min(count + amount, 2 * cap), fresh)
  return over
end

local function debit_sliding_log(key, cap, w, amount, now, tag)
  local n = sliding_log_trim(key, w, now)
  local over = overshoot(amount, cap - n)
  local k = math.min(math.floor(amount + 0.5), cap - n)
  if k < 1 then return over end
  local args = {}
  local score = fmt_int(now)
  for i = 1, k do
    args[#args + 1] = score
    args[#args + 1] = string.format('%d.d%s.%d', now, tag, i)
  end
  redis.call('ZADD', key, unpack(args))
  redis.call('PEXPIRE', key, fmt_int(math.ceil(w / 1000)))
  return over
end

local debits = {
  token_bucket = debit_token_bucket,
  gcra = debit_gcra,
  sliding_window = debit_sliding_window,
  fixed_window = debit_fixed_window,
  sliding_log = debit_sliding_log,
}
