-- Gives back amount, spent at the instant at (µs), to one bucket at now:
-- undos[algorithm](key, capacity, rate or window (µs), amount, now, at).
-- Each gives back at most what that spend took, to the window the spend
-- counted in, and nothing when that window is gone:
--   token_bucket, gcra: the state, read as a check reads it, moves back by
--     the spend of amount (the whole ns a check of amount moved it), never
--     before now;
--   fixed_window: the spend's window, if the key still holds it, counts
--     amount less, never below 0;
--   sliding_window: the spend's window, still the current or now the
--     previous one of the key, counts amount less, never below 0;
--   sliding_log: up to amount entries logged at the spend's instant go, if
--     that instant is still in the window.
-- credit(algorithm, key, capacity, rate or window, amount, now) gives back
-- amount that another region's settlement gave back (a negative spend): an
-- undo at now, and for a sliding log up to amount of the latest entries.
-- Mirrors Limit.Undo and Limit.Credit in pkg/bucket.

local function undo_instant(key, cap, rate, amount, now, at)
  local d, full = bucket_debt(key, cap, rate, now)
  if d <= 0 then return end
  d = d - spend_ns(amount, rate)
  if d <= 0 then
    redis.call('DEL', key)
  else
    bucket_write(key, now, d, full)
  end
end

local undos = {
  token_bucket = undo_instant,
  gcra = undo_instant,
  fixed_window = function(key, cap, w, amount, now, at)
    local idx = window_index(at, w)
    local count, other = fixed_window_read(key, idx)
    if not other then
      fixed_window_write(key, idx, w, math.max(micro(count - amount), 0), false)
    end
  end,
  sliding_window = function(key, cap, w, amount, now, at)
    local v = read_string(key)
    if not v then return end
    local a, cur, prev = string.match(v, '^(%d+) (%S+) (%S+)$')
    a, cur, prev = tonumber(a), micro(tonumber(cur) or 0), micro(tonumber(prev) or 0)
    local spent = window_index(at, w)
    if a == spent then
      cur = math.max(micro(cur - amount), 0)
    elseif a == spent + 1 then
      prev = math.max(micro(prev - amount), 0)
    else
      return
    end
    -- The state stops counting two windows after its own began.
    if (a + 2) * w - now > 0 then
      sliding_window_write(key, a, w, cur, prev, now)
    end
  end,
  sliding_log = function(key, cap, w, amount, now, at)
    if at <= now - w then return end
    local score = fmt_int(at)
    local members = redis.pcall('ZRANGEBYSCORE', key, score, score, 'LIMIT', 0, math.floor(amount + 0.5))
    if type(members) == 'table' and not members.err and #members > 0 then
      redis.call('ZREM', key, unpack(members))
    end
  end,
}

local function credit(alg, key, cap, rw, amount, now)
  if not (amount and amount > 0) then return end
  if alg == 'sliding_log' then
    sliding_log_trim(key, rw, now)
    local n = math.floor(amount + 0.5)
    if n > 0 then
      redis.pcall('ZPOPMAX', key, n)
    end
    return
  end
  local undo = undos[alg]
  if undo then
    undo(key, cap, rw, amount, now, now)
  end
end
